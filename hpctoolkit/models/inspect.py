"""`python -m hpctoolkit.models.inspect CONFIG_JSON`: what a draft config resolves to, as JSON.

Prints the config class and its bases, the model class, the rotary base and scaling, and every
state-dict entry with its shape. The model is built on the meta device, so K3 shapes cost no
memory.
"""

import json

from hpctoolkit.cli import parse, parser, run_cli
from hpctoolkit.models.common.rope import RotaryEmbedding
from hpctoolkit.models.registry import build_draft_model, load_draft_config


def describe(config_path: str) -> dict:
    config = load_draft_config(config_path)
    model = build_draft_model(config, device="meta")
    rotary = next((m for m in model.modules() if isinstance(m, RotaryEmbedding)), None)
    softmax_scale = next((m.softmax_scale for m in model.modules() if hasattr(m, "softmax_scale")), None)
    state = model.state_dict()
    return {
        "config_class": f"{type(config).__module__}.{type(config).__qualname__}",
        "config_bases": [f"{c.__module__}.{c.__qualname__}" for c in type(config).__mro__[1:]],
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "rotary": None
        if rotary is None
        else {
            "base": rotary.base,
            "type": rotary.spec.rope_type,
            "dim": rotary.dim,
            "interleaved": rotary.interleaved,
            "scaling": config.rope_parameters,
            "cos_sin_scale": rotary.spec.cos_sin_scale,
            "softmax_scale_factor": rotary.spec.softmax_scale_factor,
        },
        "attention_softmax_scale": softmax_scale,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "num_trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "state_dict": {name: list(t.shape) for name, t in state.items()},
    }


def main(argv: list[str]) -> int:
    ap = parser("hpctoolkit.models.inspect", __doc__)
    ap.add_argument("config", help="draft config.json (or a directory holding one)")
    args = parse(ap, argv)
    print(json.dumps(describe(args.config), indent=2))
    return 0


if __name__ == "__main__":
    run_cli(main)
