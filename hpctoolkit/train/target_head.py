# ruff: noqa: N802, N803, N815  -- shape-suffixed tensor names (hidden_BSH), per STYLE.md
"""The target's frozen output head: final norm (when the captured state is pre-norm) and lm_head.

Only the tensors the head needs are read from the target checkpoint, through `safe_open`, so a
70B target costs one `[V, H]` matrix and one `[H]` vector rather than a model load. The head is
not sharded by FSDP: every rank holds a frozen fp32 copy (bf16 on GPUs) and uses it under
`torch.no_grad()` to turn `last_hidden_states` into the target distribution.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from hpctoolkit.errors import ConfigError
from hpctoolkit.targets.resolve import read_config, text_config

_LM_HEAD = "lm_head.weight"
_EMBED = "embed_tokens.weight"
_NORM = "norm.weight"


def _checkpoint_files(target_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index when the checkpoint is sharded."""
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: target_dir / fname for name, fname in weight_map.items()}
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"paths.target_model: no *.safetensors in {target_dir}")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                out[name] = f
    return out


def _find(names: dict[str, Path], suffix: str, exclude: tuple[str, ...] = ()) -> str | None:
    """The one tensor name ending in `suffix` that belongs to the text model (shortest wins)."""
    hits = [
        n for n in names if (n == suffix or n.endswith("." + suffix)) and not any(x in n for x in exclude)
    ]
    # A vision tower may carry its own `norm.weight`; the language model's is the shallowest
    # name under `model.` / `language_model.`, and a layer-local norm always has `layers.` in it.
    hits = [n for n in hits if ".layers." not in n and "visual" not in n and "vision" not in n]
    return min(hits, key=len) if hits else None


def _read(path: Path, name: str) -> torch.Tensor:
    with safe_open(str(path), framework="pt") as fh:
        return fh.get_tensor(name)


class TargetHead(nn.Module):
    """`logits(last_NH)`: the target's next-token logits `[N, V]` (fp32) from captured last states.

    `prenorm=True` (vLLM's capture convention, manifest `extra["last_hidden_states_prenorm"]`)
    applies the target's final RMSNorm first; post-norm captures go straight to `lm_head`.
    """

    # Buffers (registered in __init__, so `.to()` moves them).
    lm_head_VH: torch.Tensor
    norm_H: torch.Tensor

    def __init__(self, lm_head_VH: torch.Tensor, norm_H: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.register_buffer("lm_head_VH", lm_head_VH, persistent=False)
        self.register_buffer("norm_H", norm_H, persistent=False)
        self.eps = eps

    @property
    def vocab_size(self) -> int:
        return self.lm_head_VH.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.lm_head_VH.shape[1]

    def final_norm(self, x_NH: torch.Tensor) -> torch.Tensor:
        x = x_NH.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * self.norm_H.float()

    @torch.no_grad()
    def logits(self, last_NH: torch.Tensor, *, prenorm: bool) -> torch.Tensor:
        if last_NH.shape[-1] != self.hidden_size:
            raise ConfigError(
                f"last_hidden_states width {last_NH.shape[-1]} != target hidden_size {self.hidden_size}"
            )
        x = self.final_norm(last_NH) if prenorm else last_NH.float()
        return torch.nn.functional.linear(x.to(self.lm_head_VH.dtype), self.lm_head_VH).float()

    def embedding_VH(self) -> torch.Tensor:
        """The target's output matrix; drafts that share it (tied targets) initialise from it."""
        return self.lm_head_VH

    @classmethod
    def from_pretrained(
        cls, target_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32
    ) -> TargetHead:
        head, norm, eps = load_head_tensors(target_dir)
        return cls(head.to(dtype), norm.to(torch.float32), eps)


def load_head_tensors(target_dir: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor, float]:
    """`(lm_head [V, H], final norm weight [H], rms_norm_eps)`, reading only those tensors.

    A tied target (`tie_word_embeddings`, or no `lm_head.weight` stored) gives its input
    embedding as the head.
    """
    target = Path(target_dir)
    cfg = read_config(target)
    text_cfg = text_config(cfg)
    eps = float(text_cfg.get("rms_norm_eps", 1e-6))
    names = _checkpoint_files(target)
    head_name = (
        None
        if text_cfg.get("tie_word_embeddings", cfg.get("tie_word_embeddings"))
        else _find(names, _LM_HEAD)
    )
    if head_name is None:
        head_name = _find(names, _EMBED)
    norm_name = _find(names, _NORM, exclude=("q_norm", "k_norm", "layernorm"))
    if head_name is None or norm_name is None:
        raise ConfigError(
            f"paths.target_model: {target} lacks an lm_head / embed_tokens or a final norm weight "
            f"(found head={head_name}, norm={norm_name})"
        )
    return _read(names[head_name], head_name), _read(names[norm_name], norm_name), eps


def read_target_layer_tensor(target_dir: str | os.PathLike, layer: int, suffix: str) -> torch.Tensor | None:
    """Tensor `suffix` (e.g. `mlp.up_proj.weight`) of the text model's decoder layer `layer`, or None."""
    names = _checkpoint_files(Path(target_dir))
    want = f"layers.{layer}.{suffix}"
    hits = [
        n for n in names if (n == want or n.endswith("." + want)) and "visual" not in n and "vision" not in n
    ]
    if not hits:
        return None
    name = min(hits, key=len)
    return _read(names[name], name)


def read_target_tensor(target_dir: str | os.PathLike, suffix: str) -> torch.Tensor | None:
    """One text-model tensor of the target by name suffix (e.g. `embed_tokens.weight`), or None."""
    names = _checkpoint_files(Path(target_dir))
    name = _find(names, suffix)
    return None if name is None else _read(names[name], name)
