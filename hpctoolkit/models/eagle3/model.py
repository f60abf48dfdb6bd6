# ruff: noqa: N803, N806, N815  -- shape-suffixed tensor names (hidden_BSH), per STYLE.md
"""Eagle3 draft: frozen embedding, aux-state projection, one decoder layer, draft vocabulary."""

from dataclasses import dataclass

import torch
from torch import nn

from hpctoolkit.errors import ConfigError
from hpctoolkit.models.common.attention import AttentionMask, GQAAttention, RopePair, causal_mask
from hpctoolkit.models.common.draft import DraftModel
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


class KVCache:
    """Keys and values of the test-time-training steps so far, kept by the caller across steps.

    A plain class, not a list: FSDP's and `torch.utils._pytree`'s argument handling rebuild
    containers (lists, tuples, dicts) on the way into a wrapped module, so a list's appends
    would land in a copy; an unregistered class passes through as a leaf.
    """

    def __init__(self) -> None:
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self.steps)

    def append(self, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add this step's keys/values; returns every step's, concatenated along the sequence."""
        self.steps.append((k_BGSD, v_BGSD))
        return torch.cat([k for k, _ in self.steps], dim=2), torch.cat([v for _, v in self.steps], dim=2)


def ttt_mask(batch: int, seq_len: int, steps: int, device: torch.device) -> AttentionMask:
    """Visibility for test-time-training step `steps - 1` over the keys of steps `0 .. steps - 1`.

    Keys are laid out step after step (`S` each). Query index `t` of any step stands for the
    draft token at position `t + step`; at serving time the drafter's cache then holds the
    context keys at positions `<= t` (step 0, from target states) and one key per earlier draft
    step at the same index `t` (positions `t + 1 ..`). So: step-0 keys causally, later steps'
    keys on the diagonal only. With `steps == 1` this is the causal mask.
    """

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        step = kv // seq_len
        idx = kv - step * seq_len
        return ((step == 0) & (idx <= q)) | ((step > 0) & (idx == q))

    return AttentionMask(mask_mod, batch, seq_len, steps * seq_len, device)


class Eagle3DecoderLayer(nn.Module):
    """vLLM's `Qwen3Eagle3DecoderLayer`: attention reads `cat(norm(embed), norm(hidden))`, 2H wide.

    `kv_cache` (test-time training): a `KVCache` the caller keeps across the unrolled steps; each call
    appends its own keys/values and attends over every step's so far with `ttt_mask`, as the
    served drafter attends over its KV cache. Without it, plain causal self-attention.
    """

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.hidden_norm = RMSNorm(config.hidden_size, eps=eps)
        self.self_attn = GQAAttention.from_config(config, 0, input_size=2 * config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(
        self,
        embeds_BSH: torch.Tensor,
        hidden_BSH: torch.Tensor,
        rope: RopePair,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        x_BSD = torch.cat([self.input_layernorm(embeds_BSH), self.hidden_norm(hidden_BSH)], dim=-1)
        B, S, _ = x_BSD.shape
        if kv_cache is None:
            attn_BSH = self.self_attn(x_BSD, x_BSD, rope, rope, causal_mask(B, S, x_BSD.device))
        else:
            q_BHSD, k_BGSD, v_BGSD = self.self_attn.project(x_BSD, x_BSD, rope, rope)
            k_all, v_all = kv_cache.append(k_BGSD, v_BGSD)
            mask = ttt_mask(B, S, len(kv_cache), x_BSD.device)
            attn_BSH = self.self_attn.attend_projected(q_BHSD, k_all, v_all, mask)
        h_BSH = hidden_BSH + attn_BSH
        return h_BSH + self.mlp(self.post_attention_layernorm(h_BSH))


class Eagle3DraftModel(DraftModel):
    """Eagle3 draft.

    forward(aux_BSC, input_ids_BS, position_ids_BS=None, *, hidden_BSH=None, return_logits=False)
      aux_BSC      [B, S, num_aux_layers * target_hidden_size], captured target states in
                   `eagle_aux_hidden_state_layer_ids` order; ignored when `hidden_BSH` is given;
      input_ids_BS [B, S] int64, the token at each position (shifted by the trainer as usual);
      hidden_BSH   [B, S, hidden_size], the previous step's `prenorm_BSH` for test-time training;
      kv_cache     a `KVCache` shared by the steps of one test-time-training unroll (see
                   `Eagle3DecoderLayer`); None for plain causal attention;
      returns      `Eagle3Output`; logits over the draft vocabulary via `compute_logits`.
    Draft-vocabulary maps: `d2t[i] = target_id(i) - i` and `t2d[target_id]` (bool), as vLLM reads them.
    """

    config: Eagle3Config
    config_class = Eagle3Config
    # Buffers (registered in __init__, saved with the weights).
    d2t: torch.Tensor
    t2d: torch.Tensor

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
        kv_cache: KVCache | None = None,
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
        prenorm_BSH = self.midlayer(embeds_BSH, hidden_BSH, self.rotary_emb(position_ids_BS), kv_cache)
        hidden = self.norm(prenorm_BSH)
        return Eagle3Output(hidden, prenorm_BSH, self.compute_logits(hidden) if return_logits else None)
