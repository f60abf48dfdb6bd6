"""Export a trained draft as a checkpoint vLLM 0.32's own draft loaders accept.

`python -m hpctoolkit.export CHECKPOINT OUT_DIR [--dtype bfloat16]` reads a directory written
by `hpctoolkit.models.save_draft` and writes `config.json` + `model.safetensors` for vLLM.
Trainers call `export_draft(model_or_state_dict, config, out_dir)` directly.

What vLLM serves, and therefore what is written:

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

import argparse
import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from hpctoolkit.errors import ConfigError
from hpctoolkit.models.checkpoint import load_state_dict
from hpctoolkit.models.common.config import DraftConfig
from hpctoolkit.models.dflash import DFlashConfig
from hpctoolkit.models.dspark import DSparkConfig
from hpctoolkit.models.eagle3 import Eagle3Config
from hpctoolkit.models.k3_dspark import K3DSparkConfig
from hpctoolkit.models.registry import build_draft_model, load_draft_config

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def unsupported_features(config: DraftConfig) -> list[str]:
    """Trained features vLLM 0.32 has no serving code for; empty when the draft is servable."""
    missing = []
    if isinstance(config, K3DSparkConfig):
        if config.fc_norm:
            missing.append(
                "fc_norm: vLLM 0.32 K3DSparkForCausalLM (models/kimi_k3/nvidia/dspark_mla.py) applies "
                "context_proj + context_norm only and has no per-target-layer norm"
            )
        if config.draft_vocab_size != config.vocab_size:
            missing.append(
                "draft_vocab_size < vocab_size: vLLM 0.32 K3DSparkConfig requires the full target vocabulary"
            )
        if not config.freeze_lm_head:
            missing.append(
                "a trained lm_head: vLLM 0.32 K3DSparkForCausalLM always aliases the target's lm_head"
            )
        if config.mla_use_output_gate:
            missing.append("mla_use_output_gate: no gate weights exist to serve")
    elif isinstance(config, DFlashConfig) and config.fc_norm:
        missing.append(
            "fc_norm: vLLM 0.32 DFlashQwen3Model / Qwen3DSparkModel (qwen3_dflash.py) have no "
            "per-target-layer norm before fc"
        )
    return missing


def _qwen3_fields(config: DraftConfig) -> dict:
    return {
        "model_type": "qwen3",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "rope_parameters": dict(config.rope_parameters),
        "attention_bias": config.attention_bias,
        "tie_word_embeddings": False,
        "target_hidden_size": config.target_hidden_size,
        "draft_vocab_size": config.draft_vocab_size,
    }


def serving_config(config: DraftConfig) -> dict:
    """The `config.json` vLLM reads for this draft."""
    if isinstance(config, Eagle3Config):
        return {
            "architectures": ["Eagle3Qwen3ForCausalLM"],
            **_qwen3_fields(config),
            "eagle_aux_hidden_state_layer_ids": list(config.eagle_aux_hidden_state_layer_ids),
            "norm_before_fc": config.norm_before_fc,
            "fc_norm": config.fc_norm,
        }
    if isinstance(config, K3DSparkConfig):
        return {
            "architectures": ["K3DSparkModel"],
            "model_type": "k3_dspark",
            "vocab_size": config.vocab_size,
            "draft_vocab_size": config.draft_vocab_size,
            "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_attention_heads,
            "q_lora_rank": config.q_lora_rank,
            "kv_lora_rank": config.kv_lora_rank,
            "qk_nope_head_dim": config.qk_nope_head_dim,
            "qk_rope_head_dim": config.qk_rope_head_dim,
            "v_head_dim": config.v_head_dim,
            "hidden_act": config.hidden_act,
            "rms_norm_eps": config.rms_norm_eps,
            "max_position_embeddings": config.max_position_embeddings,
            "rope_theta": config.rope_theta,
            "rope_parameters": dict(config.rope_parameters),
            "tie_word_embeddings": False,
            **_block_fields(config),
        }
    if isinstance(config, DFlashConfig):
        arch = "Qwen3DSparkModel" if isinstance(config, DSparkConfig) else "DFlashDraftModel"
        return {"architectures": [arch], **_qwen3_fields(config), **_block_fields(config)}
    raise ConfigError(f"no serving format for {type(config).__name__}")


def _block_fields(config: DFlashConfig) -> dict:
    fields = {
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids),
        "num_target_layers": config.num_target_layers,
        "target_hidden_size": config.target_hidden_size,
        "dflash_config": {
            "mask_token_id": config.mask_token_id,
            "target_layer_ids": list(config.target_layer_ids),
        },
    }
    if isinstance(config, DSparkConfig):
        fields |= {
            "markov_rank": config.markov_rank,
            "enable_confidence_head": config.enable_confidence_head,
            "confidence_head_with_markov": config.confidence_head_with_markov,
        }
    return fields


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
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpctoolkit.export", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="directory with config.json + model.safetensors (save_draft)")
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    args = parser.parse_args(argv)
    config = load_draft_config(args.checkpoint)
    out = export_draft(load_state_dict(args.checkpoint), config, args.out_dir, dtype=DTYPES[args.dtype])
    print(f"exported {type(config).__name__} to {out}")
    return 0


if __name__ == "__main__":
    from hpctoolkit.cli import run_cli

    run_cli(main)
