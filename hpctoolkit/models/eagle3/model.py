# ruff: noqa: N803, N806, N815  -- shape-suffixed tensor names (hidden_BSH), per STYLE.md
"""Eagle3 draft: frozen embedding, aux-state projection, one decoder layer, draft vocabulary."""

from dataclasses import dataclass

import torch
from torch import nn

from hpctoolkit.errors import ConfigError
from hpctoolkit.models.common.attention import GQAAttention, RopePair, causal_mask
from hpctoolkit.models.common.mlp import GatedMLP
from hpctoolkit.models.common.norm import RMSNorm
from hpctoolkit.models.common.rope import RopeSpec, RotaryEmbedding
from hpctoolkit.models.eagle3.config import Eagle3Config


@dataclass
class Eagle3Output:
    """`hidden_BSH` final-normed (feeds `lm_head`), `prenorm_BSH` (feeds the next test-time step)."""

    hidden_BSH: torch.Tensor
    prenorm_BSH: torch.Tensor
    logits_BSV: torch.Tensor | None = None


class Eagle3DecoderLayer(nn.Module):
    """vLLM's `Qwen3Eagle3DecoderLayer`: attention reads `cat(norm(embed), norm(hidden))`, 2H wide."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.hidden_norm = RMSNorm(config.hidden_size, eps=eps)
        self.self_attn = GQAAttention.from_config(config, 0, input_size=2 * config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, embeds_BSH: torch.Tensor, hidden_BSH: torch.Tensor, rope: RopePair) -> torch.Tensor:
        x_BSD = torch.cat([self.input_layernorm(embeds_BSH), self.hidden_norm(hidden_BSH)], dim=-1)
        B, S, _ = x_BSD.shape
        h_BSH = hidden_BSH + self.self_attn(x_BSD, x_BSD, rope, rope, causal_mask(B, S, x_BSD.device))
        return h_BSH + self.mlp(self.post_attention_layernorm(h_BSH))


class Eagle3DraftModel(nn.Module):
    """Eagle3 draft.

    forward(aux_BSC, input_ids_BS, position_ids_BS=None, *, hidden_BSH=None, return_logits=False)
      aux_BSC      [B, S, num_aux_layers * target_hidden_size], captured target states in
                   `eagle_aux_hidden_state_layer_ids` order; ignored when `hidden_BSH` is given;
      input_ids_BS [B, S] int64, the token at each position (shifted by the trainer as usual);
      hidden_BSH   [B, S, hidden_size], the previous step's `prenorm_BSH` for test-time training;
      returns      `Eagle3Output`; logits over the draft vocabulary via `compute_logits`.
    Draft-vocabulary maps: `d2t[i] = target_id(i) - i` and `t2d[target_id]` (bool), as vLLM reads them.
    """

    config_class = Eagle3Config

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        if not isinstance(config, Eagle3Config):
            raise ConfigError(f"Eagle3DraftModel needs an Eagle3Config, got {type(config).__name__}")
        self.config = c = config
        aux_width = c.num_aux_layers * c.target_hidden_size
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        if c.norm_before_fc:
            self.input_norm = RMSNorm(aux_width, eps=c.rms_norm_eps)
        if c.fc_norm:
            self.fc_norm = nn.ModuleList(
                RMSNorm(c.target_hidden_size, eps=c.rms_norm_eps) for _ in range(c.num_aux_layers)
            )
        self.fc = nn.Linear(aux_width, c.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(c)
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        if c.freeze_lm_head:
            self.lm_head.weight.requires_grad_(False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.t2d[: c.draft_vocab_size] = True
        self.rotary_emb = RotaryEmbedding(c.head_dim, RopeSpec.from_config(c))

    def set_vocab_mapping(self, draft_to_target_ids: torch.Tensor) -> None:
        """Install the pruned vocabulary: entry `i` is the target id of draft token `i` (ascending)."""
        ids = draft_to_target_ids.to(self.d2t.device, torch.long)
        if ids.shape != self.d2t.shape:
            raise ConfigError(f"need {self.d2t.numel()} draft ids, got {ids.numel()}")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def project_aux(self, aux_BSC: torch.Tensor) -> torch.Tensor:
        c = self.config
        if c.norm_before_fc:
            aux_BSC = self.input_norm(aux_BSC)
        if c.fc_norm:
            chunks = aux_BSC.chunk(c.num_aux_layers, dim=-1)
            aux_BSC = torch.cat([n(x) for n, x in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(aux_BSC)

    def compute_logits(self, hidden_BSH: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_BSH)

    def forward(
        self,
        aux_BSC: torch.Tensor | None,
        input_ids_BS: torch.Tensor,
        position_ids_BS: torch.Tensor | None = None,
        *,
        hidden_BSH: torch.Tensor | None = None,
        return_logits: bool = False,
    ) -> Eagle3Output:
        if hidden_BSH is None:
            if aux_BSC is None:
                raise ConfigError("Eagle3DraftModel.forward needs aux_BSC or hidden_BSH")
            hidden_BSH = self.project_aux(aux_BSC)
        B, S = input_ids_BS.shape
        if position_ids_BS is None:
            position_ids_BS = torch.arange(S, device=input_ids_BS.device).expand(B, S)
        embeds_BSH = self.embed_tokens(input_ids_BS).to(hidden_BSH.dtype)
        prenorm_BSH = self.midlayer(embeds_BSH, hidden_BSH, self.rotary_emb(position_ids_BS))
        hidden = self.norm(prenorm_BSH)
        return Eagle3Output(hidden, prenorm_BSH, self.compute_logits(hidden) if return_logits else None)
