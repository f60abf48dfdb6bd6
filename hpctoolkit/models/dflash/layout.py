# ruff: noqa: N803, N806, N815  -- shape-suffixed tensor names (hidden_BSH), per STYLE.md
"""Block/anchor layout shared by DFlash-family training (public: the trainer builds batches with it).

Vocabulary (per sample `b`, `N` blocks of `K = block_size` slots, `T = N * K` draft tokens):

- anchor `a = anchors_BN[b, n]`: a position of the target sequence whose token is known but
  whose target hidden state is not (at serving time it is the bonus token);
- block `n` holds slots `k = 0..K-1` at absolute positions `a + k`; slot 0 carries the anchor
  token, slots `1..K-1` carry `mask_token_id` and are trained to predict `input_ids[a + k]`;
- the K side is `cat(context, draft)`: `S` context keys at positions `0..S-1`, then the `T`
  draft keys at their block positions;
- a query in block `n` sees context keys at positions `< a` and every key of its own block
  (bidirectional), and nothing of other blocks.
"""

from dataclasses import dataclass

import torch

from hpctoolkit.errors import ConfigError
from hpctoolkit.models.common.attention import AttentionMask
from hpctoolkit.models.common.fused_ce import IGNORE_INDEX  # one value for every loss


@dataclass(frozen=True)
class BlockLayout:
    """Anchors and sizes for one batch. Build with `make_block_layout`."""

    anchors_BN: torch.Tensor
    block_size: int
    context_len: int
    valid_BN: torch.Tensor | None = None

    @property
    def batch(self) -> int:
        return self.anchors_BN.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.anchors_BN.shape[1]

    @property
    def draft_len(self) -> int:
        return self.num_blocks * self.block_size

    def q_position_ids(self) -> torch.Tensor:
        """`[B, T]` absolute positions of the draft slots (`anchor + k`)."""
        return q_position_ids(self.anchors_BN, self.block_size)

    def k_position_ids(self) -> torch.Tensor:
        """`[B, S + T]` positions of the keys: context `0..S-1`, then the draft slots."""
        return k_position_ids(self.anchors_BN, self.block_size, self.context_len)

    def attention_mask(self) -> AttentionMask:
        return block_attention_mask(self.anchors_BN, self.block_size, self.context_len)

    def block_input_ids(self, input_ids_BS: torch.Tensor, mask_token_id: int) -> torch.Tensor:
        """`[B, T]`: the anchor token in slot 0, `mask_token_id` elsewhere."""
        anchor_tok_BN = input_ids_BS.gather(1, self.anchors_BN)
        ids_BNK = torch.full(
            (self.batch, self.num_blocks, self.block_size),
            mask_token_id,
            dtype=input_ids_BS.dtype,
            device=input_ids_BS.device,
        )
        ids_BNK[:, :, 0] = anchor_tok_BN
        return ids_BNK.flatten(1)

    def labels(self, input_ids_BS: torch.Tensor, loss_mask_BS: torch.Tensor | None = None) -> torch.Tensor:
        """`[B, T]` targets `input_ids[a + k]`; `IGNORE_INDEX` at slot 0, past the end, in an invalid
        block (`valid_BN`), or where `loss_mask_BS` is 0."""
        pos_BT = self.q_position_ids()
        in_range = pos_BT < input_ids_BS.shape[1]
        safe = pos_BT.clamp(max=input_ids_BS.shape[1] - 1)
        labels = input_ids_BS.gather(1, safe)
        keep = in_range & (slot_index(self.num_blocks, self.block_size, pos_BT.device) > 0)
        if self.valid_BN is not None:
            keep &= self.valid_BN.repeat_interleave(self.block_size, dim=1)
        if loss_mask_BS is not None:
            keep &= loss_mask_BS.gather(1, safe).bool()
        return labels.masked_fill(~keep, IGNORE_INDEX)

    def prev_token_ids(self, input_ids_BS: torch.Tensor) -> torch.Tensor:
        """`[B, T]` ground-truth token before each slot (`input_ids[a + k - 1]`), for the markov head."""
        prev = (self.q_position_ids() - 1).clamp(0, input_ids_BS.shape[1] - 1)
        return input_ids_BS.gather(1, prev)


def slot_index(num_blocks: int, block_size: int, device: torch.device) -> torch.Tensor:
    """`[1, T]` slot index `k` of each draft token."""
    return torch.arange(block_size, device=device).repeat(num_blocks).unsqueeze(0)


def q_position_ids(anchors_BN: torch.Tensor, block_size: int) -> torch.Tensor:
    offs = torch.arange(block_size, device=anchors_BN.device)
    return (anchors_BN.unsqueeze(-1) + offs).flatten(1)


def k_position_ids(anchors_BN: torch.Tensor, block_size: int, context_len: int) -> torch.Tensor:
    ctx = torch.arange(context_len, device=anchors_BN.device).expand(anchors_BN.shape[0], -1)
    return torch.cat([ctx, q_position_ids(anchors_BN, block_size)], dim=1)


def block_attention_mask(anchors_BN: torch.Tensor, block_size: int, context_len: int) -> AttentionMask:
    """Mask over `Q = T` draft queries and `K = S + T` keys (see the module docstring)."""
    B, N = anchors_BN.shape
    T = N * block_size
    anchors = anchors_BN

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        q_block = q // block_size
        is_ctx = kv < context_len
        sees_ctx = is_ctx & (kv < anchors[b, q_block])
        same_block = (~is_ctx) & ((kv - context_len) // block_size == q_block)
        return sees_ctx | same_block

    return AttentionMask(mask_mod, B, T, context_len + T, anchors_BN.device)


def check_anchor_range(anchors_BN: torch.Tensor, context_len: int) -> None:
    if anchors_BN.numel() and (int(anchors_BN.min()) < 0 or int(anchors_BN.max()) >= context_len):
        raise ConfigError(f"anchors must lie in [0, {context_len})")


def make_block_layout(
    anchors_BN: torch.Tensor, block_size: int, context_len: int, valid_BN: torch.Tensor | None = None
) -> BlockLayout:
    """Validate and wrap anchors; `valid_BN` (from `sample_anchors`) drops padding blocks from the labels."""
    if valid_BN is not None and valid_BN.shape != anchors_BN.shape:
        raise ConfigError(
            f"valid_BN shape {tuple(valid_BN.shape)} != anchors_BN shape {tuple(anchors_BN.shape)}"
        )
    if anchors_BN.dtype != torch.long or anchors_BN.dim() != 2:
        raise ConfigError("anchors_BN must be a [batch, num_blocks] int64 tensor")
    # Checked where the anchors are drawn, on the host: on a device, reading their range back would
    # wait for every step queued before this one (the trainers draw them with `sample_anchors`,
    # which keeps them in range, and check them there).
    if anchors_BN.device.type == "cpu":
        check_anchor_range(anchors_BN, context_len)
    return BlockLayout(anchors_BN, block_size, context_len, valid_BN)


def sample_anchors(
    loss_mask_BS: torch.Tensor,
    num_blocks: int,
    block_size: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw `num_blocks` distinct anchors per sample where a whole block fits before the end.

    Returns `(anchors_BN, valid_BN)`. Samples with fewer eligible positions repeat an anchor and
    mark the surplus invalid; pass `valid_BN` to `make_block_layout` so their labels are ignored. Position 0
    is never an anchor: a block needs at least one context state.
    """
    B, S = loss_mask_BS.shape
    eligible_BS = loss_mask_BS.bool().clone()
    eligible_BS[:, 0] = False
    if block_size - 1 < S:
        eligible_BS[:, S - block_size + 1 :] = False
    noise = torch.rand(B, S, generator=generator, device=loss_mask_BS.device)
    score = torch.where(eligible_BS, noise, torch.full_like(noise, -1.0))
    top_BN = score.topk(min(num_blocks, S), dim=1)
    anchors_BN = top_BN.indices
    valid_BN = top_BN.values >= 0
    ordered = torch.where(valid_BN, anchors_BN, anchors_BN[:, :1]).sort(dim=1)
    valid_BN = valid_BN.gather(1, ordered.indices)
    if ordered.values.shape[1] < num_blocks:
        raise ConfigError(f"sequence length {S} is shorter than num_blocks={num_blocks}")
    return ordered.values, valid_BN
