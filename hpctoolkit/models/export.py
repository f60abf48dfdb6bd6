"""Export a trained draft as a checkpoint vLLM 0.32's own draft loaders accept.

`python -m hpctoolkit.models.export CHECKPOINT OUT_DIR [--dtype bfloat16]` reads a directory
written by `hpctoolkit.models.save_draft` and writes `config.json` + `model.safetensors` for vLLM.
Trainers call `export_draft(model_or_state_dict, config, out_dir)` directly.

What vLLM serves, and therefore what is written, is each family's `Serving` record
(`models/<family>/serving.py`): the architecture, the `config.json` fields, and the trained
features vLLM 0.32 has no serving code for.

| draft  | architecture             | served by (vllm 0.32)                       |
|--------|--------------------------|---------------------------------------------|
| Eagle3 | `Eagle3Qwen3ForCausalLM` | `model_executor/models/qwen3_eagle3.py`     |
| DFlash | `DFlashDraftModel`       | `model_executor/models/qwen3_dflash.py`     |
| DSpark | `Qwen3DSparkModel`       | `model_executor/models/qwen3_dspark.py`     |
| K3     | `K3DSparkModel`          | `models/kimi_k3/nvidia/dspark_mla.py`       |

Our module names already are the serving checkpoint names, so export is a filter plus a config
rewrite: the frozen embedding (and a frozen full-vocabulary `lm_head`) are dropped because vLLM
shares the target's; `t2d` is dropped because vLLM never reads it; `d2t` is kept only for a
pruned vocabulary, the one case where vLLM builds a parameter for it. A trained feature with no
serving counterpart is refused with `ConfigError` rather than exported and silently ignored,
because vLLM's draft `load_weights` does not report unused or missing weights.
"""

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from hpctoolkit.cli import parse, parser, run_cli
from hpctoolkit.dtypes import WEIGHT_DTYPES, dtype_name, torch_dtype
from hpctoolkit.errors import ConfigError
from hpctoolkit.models.checkpoint import load_state_dict
from hpctoolkit.models.common.config import DraftConfig
from hpctoolkit.models.families import serving_for
from hpctoolkit.models.registry import build_draft_model, load_draft_config
from hpctoolkit.rundir.atomic import atomic_path, write_json_atomic


def unsupported_features(config: DraftConfig) -> list[str]:
    """Trained features vLLM 0.32 has no serving code for; empty when the draft is servable."""
    return serving_for(config).unsupported(config)


def serving_config(config: DraftConfig) -> dict:
    """The `config.json` vLLM reads for this draft."""
    serving = serving_for(config)
    return {"architectures": [serving.served_architecture], **serving.config_fields(config)}


def _keep(name: str, config: DraftConfig) -> bool:
    reduced = config.draft_vocab_size < config.vocab_size
    if name.startswith("embed_tokens.") or name == "t2d":
        return False
    if name == "d2t":
        return reduced
    if name.startswith("lm_head."):
        # A frozen full-vocabulary head is the target's own; vLLM aliases it when absent.
        return reduced or not getattr(config, "freeze_lm_head", False)
    return True


def _check_against_model(state: Mapping[str, torch.Tensor], config: DraftConfig) -> None:
    """Fail closed: the state dict must be exactly what our model for `config` holds."""
    reference = build_draft_model(config, device="meta").state_dict()
    missing = sorted(set(reference) - set(state))
    unexpected = sorted(set(state) - set(reference))
    if missing or unexpected:
        raise ConfigError(
            f"state dict does not match {type(config).__name__}: missing {missing}, unexpected {unexpected}"
        )
    wrong = [
        f"{k} {tuple(state[k].shape)} != {tuple(v.shape)}"
        for k, v in reference.items()
        if state[k].shape != v.shape
    ]
    if wrong:
        raise ConfigError(f"state dict shapes do not match the config: {wrong}")


def export_tensors(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor], config: DraftConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The tensors of the serving checkpoint (name -> tensor), without writing anything."""
    missing = unsupported_features(config)
    if missing:
        raise ConfigError(f"{type(config).__name__} cannot be served by vLLM 0.32: " + "; ".join(missing))
    state = (
        model_or_state_dict.state_dict()
        if isinstance(model_or_state_dict, nn.Module)
        else model_or_state_dict
    )
    _check_against_model(state, config)
    out = {}
    for name, tensor in state.items():
        if not _keep(name, config):
            continue
        t = tensor.detach().cpu()
        if t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.contiguous()
    return out


def export_draft(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    config: DraftConfig,
    out_dir: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write `out_dir/config.json` and `out_dir/model.safetensors` for vLLM; returns `out_dir`.

    `model_or_state_dict` holds our module names (a model, or e.g. a state dict gathered from a
    torch.distributed checkpoint). Raises `ConfigError` when vLLM 0.32 cannot serve a feature.
    """
    tensors = export_tensors(model_or_state_dict, config, dtype)
    cfg = serving_config(config)
    cfg["torch_dtype"] = dtype_name(dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    write_json_atomic(out / "config.json", cfg, indent=2, sort_keys=True)
    return out


def main(argv: list[str]) -> int:
    ap = parser("hpctoolkit.models.export", __doc__)
    ap.add_argument("checkpoint", help="directory with config.json + model.safetensors (save_draft)")
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", choices=WEIGHT_DTYPES, default="bfloat16")
    args = parse(ap, argv)
    config = load_draft_config(args.checkpoint)
    out = export_draft(load_state_dict(args.checkpoint), config, args.out_dir, dtype=torch_dtype(args.dtype))
    print(f"exported {type(config).__name__} to {out}")
    return 0


if __name__ == "__main__":
    run_cli(main)
