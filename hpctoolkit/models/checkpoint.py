"""Plain draft checkpoints: `config.json` + `model.safetensors` holding our module names."""

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hpctoolkit.errors import ConfigError
from hpctoolkit.models.common.config import DraftConfig
from hpctoolkit.models.common.draft import DraftModel
from hpctoolkit.models.registry import architecture_for, build_draft_model, load_draft_config
from hpctoolkit.rundir.atomic import atomic_path, write_json_atomic

WEIGHTS_NAME = "model.safetensors"


def config_to_dict(config: DraftConfig) -> dict:
    """The config as JSON-ready dict, with `architectures` naming our model class."""
    data = config.to_dict()
    data["architectures"] = [architecture_for(config)]
    return data


def save_draft(model: DraftModel, out_dir: str | Path) -> Path:
    """Write `config.json` and `model.safetensors` (full state dict, buffers included)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "config.json", config_to_dict(model.config), indent=2, sort_keys=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    with atomic_path(out / WEIGHTS_NAME) as tmp:
        save_file(state, str(tmp))
    return out


def load_state_dict(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    path = Path(ckpt_dir) / WEIGHTS_NAME
    if not path.exists():
        raise ConfigError(f"{path} does not exist; expected a directory written by save_draft")
    return load_file(str(path))


def load_draft(ckpt_dir: str | Path, *, strict: bool = True) -> DraftModel:
    """Inverse of `save_draft`."""
    config = load_draft_config(ckpt_dir)
    model = build_draft_model(config)
    model.load_state_dict(load_state_dict(ckpt_dir), strict=strict)
    return model
