# ruff: noqa: N803, N806, N815  -- shape-suffixed tensor names (hidden_BSH), per STYLE.md
"""DFlash draft: a context projection over captured target layers plus dual-source decoder layers."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hpctoolkit.errors import ConfigError
from hpctoolkit.models.common.attention import AttentionMask, GQAAttention, RopePair
from hpctoolkit.models.common.draft import DraftModel
from hpctoolkit.models.common.mla import MLAAttention
from hpctoolkit.models.common.mlp import GatedMLP
from hpctoolkit.models.common.norm import RMSNorm
from hpctoolkit.models.common.rope import RopeSpec, RotaryEmbedding
from hpctoolkit.models.dflash.config import DFlashConfig
from hpctoolkit.models.dflash.layout import BlockLayout


@dataclass
class DFlashOutput:
    """`hidden_BTH`: final-normed states per draft slot, before `lm_head`; `logits_BTV` only on request."""

    hidden_BTH: torch.Tensor
    logits_BTV: torch.Tensor | None = None


class DFlashDecoderLayer(nn.Module):
    """Pre-norm decoder layer whose attention reads `cat(context, draft)` for K and V.

    The context enters K/V as projected by the model (`hidden_norm(fc(...))`), not through this
    layer's `input_layernorm`: that is how vLLM precomputes context KV at serving time.
    """

    def __init__(
        self, config: DFlashConfig, layer_idx: int, attention_class: type[GQAAttention] | type[MLAAttention]
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = attention_class.from_config(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(
        self,
        x_BTH: torch.Tensor,
        context_BSH: torch.Tensor,
        rope_q: RopePair,
        rope_k: RopePair,
        mask: AttentionMask,
    ) -> torch.Tensor:
        h_BTH = self.input_layernorm(x_BTH)
        kv_BLH = torch.cat([context_BSH, h_BTH], dim=1)
        x_BTH = x_BTH + self.self_attn(h_BTH, kv_BLH, rope_q, rope_k, mask)
        return x_BTH + self.mlp(self.post_attention_layernorm(x_BTH))


class DFlashDraftModel(DraftModel):
    """DFlash draft.

    forward(context_BSC, input_ids_BS, layout, *, return_logits=False) -> DFlashOutput
      context_BSC  [B, S, num_target_layers * target_hidden_size], the captured target states
                   concatenated in `target_layer_ids` order (what the Mooncake sample carries);
      input_ids_BS [B, S] int64, the target sequence (anchors index into it);
      layout       `BlockLayout` from `dflash.layout.make_block_layout` (anchors, block size);
      returns      `hidden_BTH` [B, T = num_blocks * block_size, hidden_size] after the final norm.
                   Logits are `model.compute_logits(hidden_BTH)` -> [B, T, draft_vocab_size]; the
                   loss should chunk over T instead (`dflash.loss.block_cross_entropy`).

    GPU training: `set_attention_backend("flex")` (block-sparse) and `compile_layers()`; see
    `benchmarks/draft_step.py` for what each buys at K3 shapes.

    Subclass hooks: `attention_class` (built with `.from_config(config, layer_idx)`),
    `decoder_layer_class`, and `context_proj_name` / `context_norm_name` / `final_norm_name`,
    which name the projection modules so a variant's state dict matches its serving checkpoint.
    """

    config: DFlashConfig
    config_class: type[DFlashConfig] = DFlashConfig
    attention_class: type[GQAAttention] | type[MLAAttention] = GQAAttention
    decoder_layer_class: type[DFlashDecoderLayer] = DFlashDecoderLayer
    context_proj_name = "fc"
    context_norm_name = "hidden_norm"
    final_norm_name = "norm"

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        if not isinstance(config, self.config_class):
            raise ConfigError(
                f"{type(self).__name__} needs a {self.config_class.__name__}, got {type(config).__name__}"
            )
        self.config = config
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        if c.fc_norm:
            self.fc_norm = nn.ModuleList(
                RMSNorm(c.target_hidden_size, eps=c.rms_norm_eps) for _ in range(c.num_target_layers)
            )
        self.add_module(
            self.context_proj_name,
            nn.Linear(c.num_target_layers * c.target_hidden_size, c.hidden_size, bias=False),
        )
        self.add_module(self.context_norm_name, RMSNorm(c.hidden_size, eps=c.rms_norm_eps))
        self.layers = nn.ModuleList(
            self.decoder_layer_class(c, i, self.attention_class) for i in range(c.num_hidden_layers)
        )
        self.add_module(self.final_norm_name, RMSNorm(c.hidden_size, eps=c.rms_norm_eps))
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        if c.freeze_lm_head:
            self.lm_head.weight.requires_grad_(False)
        self.rotary_emb = self.build_rotary(c)
        # The first this many decoder layers recompute their activations in backward.
        self.checkpoint_layers = 0
        self._project_context: Callable[[torch.Tensor], torch.Tensor] | None = None  # by `compile_layers`

    def set_activation_checkpointing(self, num_layers: int) -> None:
        """Recompute the first `num_layers` decoder layers in backward (0: keep all activations).

        Each checkpointed layer keeps only its input; its K/V-side activations (several GiB per
        layer at 64k context) are rebuilt from it when backward reaches the layer.
        """
        if not 0 <= num_layers <= len(self.layers):
            raise ConfigError(
                f"cannot checkpoint {num_layers} decoder layers: the draft has {len(self.layers)}"
            )
        self.checkpoint_layers = num_layers

    def compile_layers(self, **compile_kwargs: Any) -> None:
        """`torch.compile` each decoder layer in place (state-dict names unchanged), and the
        context projection.

        Fuses the norms, rotary and SwiGLU elementwise work around the GEMMs; all layers share
        one graph. The context projection's per-layer fp32 norms over `[S, L * Ht]` are, eager,
        the largest saved activations at long context (about 15 GiB at 64k K3 context); fused,
        only their bf16 input is kept. Set `config.attention_backend` before the first forward.
        """
        kwargs = {"dynamic": False} | compile_kwargs
        for layer in self.layers:
            layer.compile(**kwargs)
        self._project_context = torch.compile(self.project_context, **kwargs)

    def set_attention_backend(self, backend: str) -> None:
        """Switch every layer between `sdpa` and `flex` (e.g. flex on GPU, sdpa for CPU backward)."""
        self.config.attention_backend = backend
        self.config.validate()
        for module in self.modules():
            if isinstance(module, (GQAAttention, MLAAttention)):
                module.backend = backend

    def build_rotary(self, config: DFlashConfig) -> RotaryEmbedding:
        return RotaryEmbedding(config.head_dim, RopeSpec.from_config(config))

    def project_context(self, context_BSC: torch.Tensor) -> torch.Tensor:
        """`[B, S, L * Ht] -> [B, S, H]`: optional per-layer `fc_norm`, projection, norm."""
        c = self.config
        if context_BSC.shape[-1] != c.num_target_layers * c.target_hidden_size:
            raise ConfigError(
                f"context width {context_BSC.shape[-1]} != num_target_layers * target_hidden_size "
                f"= {c.num_target_layers} * {c.target_hidden_size}"
            )
        if c.fc_norm:
            chunks = context_BSC.chunk(c.num_target_layers, dim=-1)
            context_BSC = torch.cat([n(x) for n, x in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        proj = getattr(self, self.context_proj_name)
        norm = getattr(self, self.context_norm_name)
        return norm(proj(context_BSC))

    def backbone(
        self, context_BSC: torch.Tensor, input_ids_BS: torch.Tensor, layout: BlockLayout
    ) -> torch.Tensor:
        """Run the decoder stack; returns final-normed `hidden_BTH`."""
        context_BSH = (self._project_context or self.project_context)(context_BSC)
        mask_token_id = self.config.mask_token_id
        if mask_token_id is None:  # validate() refuses it; a config changed after the build
            raise ConfigError("mask_token_id is unset: DFlash drafts need a mask token")
        x_BTH = self.embed_tokens(layout.block_input_ids(input_ids_BS, mask_token_id))
        x_BTH = x_BTH.to(context_BSH.dtype)
        rope_q = self.rotary_emb(layout.q_position_ids())
        rope_k = self.rotary_emb(layout.k_position_ids())
        mask = layout.attention_mask().materialize(self.config.attention_backend)
        for i, layer in enumerate(self.layers):
            if i < self.checkpoint_layers and torch.is_grad_enabled():
                # FSDP2 casts a layer's floating inputs (the fp32 rope pairs) to its compute dtype
                # in its forward pre-hook, but skips that hook when the checkpoint recomputes the
                # layer in backward; the recompute then saw fp32 rope where the forward saw bf16
                # (CheckpointError on one H200). Hand the layer rope already in x's dtype (the
                # compute dtype), so that forward and recompute see the same tensors.
                rq, rk = (tuple(t.to(x_BTH.dtype) for t in r) for r in (rope_q, rope_k))
                x_BTH = checkpoint(layer, x_BTH, context_BSH, rq, rk, mask, use_reentrant=False)
            else:
                x_BTH = layer(x_BTH, context_BSH, rope_q, rope_k, mask)
        return getattr(self, self.final_norm_name)(x_BTH)

    def compute_logits(self, hidden_BTH: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_BTH)

    def forward(
        self,
        context_BSC: torch.Tensor,
        input_ids_BS: torch.Tensor,
        layout: BlockLayout,
        *,
        return_logits: bool = False,
    ) -> DFlashOutput:
        hidden_BTH = self.backbone(context_BSC, input_ids_BS, layout)
        return DFlashOutput(hidden_BTH, self.compute_logits(hidden_BTH) if return_logits else None)
