# ruff: noqa: N803, N806  -- shape-suffixed tensor names (hidden_NH), per STYLE.md
"""Cross-entropy fused with the output projection, never holding `[N, V]` logits for all rows.

Logits are `hidden_NH @ w_VH.T (+ extra_NR @ w_extra_VR.T)`; DSpark passes its markov features
as the extra term. The forward walks row chunks, and for each one computes the loss and, at
once, the gradients (softmax minus one-hot), so backward only rescales stored gradients: no
`[N, V]` tensor is ever alive, and no chunk's logits are recomputed. Weight gradients are formed
only for weights that require them (the frozen `lm_head` costs nothing there). Rows labelled
`IGNORE_INDEX` are dropped before the first GEMM (one device sync to count them): DFlash's slot 0
alone is 1/block_size of the rows, and masked prompt tokens can be most of a real batch.
"""

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def _ce_rows(logits_NV: torch.Tensor, labels_N: torch.Tensor, keep_N: torch.Tensor, grad_dtype: torch.dtype):
    """Per chunk: summed loss, `d loss_sum / d logits` (softmax - onehot on kept rows), argmax hits."""
    logits = logits_NV.float()
    lse = torch.logsumexp(logits, dim=-1)
    safe = labels_N.clamp(min=0)
    picked = logits.gather(1, safe.unsqueeze(1)).squeeze(1)
    loss_sum = ((lse - picked) * keep_N).sum()
    hit = logits.argmax(-1) == labels_N
    grad = torch.exp(logits - lse.unsqueeze(1))
    grad = grad.scatter_add(1, safe.unsqueeze(1), -torch.ones_like(lse).unsqueeze(1))
    return loss_sum, (grad * keep_N.unsqueeze(1)).to(grad_dtype), hit


_compiled_ce_rows = None


def _ce_rows_fn(compiled: bool):
    global _compiled_ce_rows
    if not compiled:
        return _ce_rows
    if _compiled_ce_rows is None:
        _compiled_ce_rows = torch.compile(_ce_rows, dynamic=False)
    return _compiled_ce_rows


def _expand_rows(t: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """Scatter per-kept-row values back to all `n` rows (zeros / False elsewhere)."""
    out = t.new_zeros((n, *t.shape[1:]))
    return out.index_copy_(0, rows, t)


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, w_VH, extra_NR, w_extra_VR, labels_N, chunk_size, compiled):
        full_n = hidden_NH.shape[0]
        valid_N = labels_N != IGNORE_INDEX
        count = valid_N.sum().clamp(min=1)
        # Ignored rows (DFlash's slot 0, masked prompt tokens, padding) contribute neither loss nor
        # gradient: drop them before the vocabulary GEMMs instead of multiplying them by zero.
        rows = valid_N.nonzero().squeeze(1)
        compact = rows.numel() < full_n
        grad_hidden = hidden_NH.requires_grad
        grad_extra = extra_NR is not None and extra_NR.requires_grad
        if compact:
            hidden_NH = hidden_NH.index_select(0, rows)
            labels_N = labels_N.index_select(0, rows)
            valid_N = valid_N.index_select(0, rows)
            if extra_NR is not None:
                extra_NR = extra_NR.index_select(0, rows)
        n = hidden_NH.shape[0]
        g_hidden = torch.zeros_like(hidden_NH) if grad_hidden else None
        g_w = torch.zeros_like(w_VH, dtype=torch.float32) if w_VH.requires_grad else None
        has_extra = extra_NR is not None
        g_extra = torch.zeros_like(extra_NR) if grad_extra else None
        g_w_extra = (
            torch.zeros_like(w_extra_VR, dtype=torch.float32)
            if has_extra and w_extra_VR.requires_grad
            else None
        )
        loss_sum = hidden_NH.new_zeros((), dtype=torch.float32)
        hit_N = torch.zeros(n, dtype=torch.bool, device=hidden_NH.device)
        ce_rows = _ce_rows_fn(compiled)
        for start in range(0, n, chunk_size):
            sl = slice(start, min(start + chunk_size, n))
            logits = hidden_NH[sl] @ w_VH.t()
            if has_extra:
                logits = torch.addmm(logits, extra_NR[sl], w_extra_VR.t())
            chunk_loss, grad, hit_N[sl] = ce_rows(logits, labels_N[sl], valid_N[sl], hidden_NH.dtype)
            loss_sum += chunk_loss
            if g_hidden is not None:
                g_hidden[sl] = grad @ w_VH
            if g_w is not None:
                g_w += (grad.t() @ hidden_NH[sl]).float()
            if g_extra is not None:
                g_extra[sl] = grad @ w_extra_VR
            if g_w_extra is not None:
                g_w_extra += (grad.t() @ extra_NR[sl]).float()
        if compact:
            g_hidden, g_extra = (
                None if g is None else _expand_rows(g, rows, full_n) for g in (g_hidden, g_extra)
            )
            hit_N = _expand_rows(hit_N, rows, full_n)
        ctx.save_for_backward(count)
        ctx.grads = (g_hidden, g_w, g_extra, g_w_extra)
        ctx.dtypes = (w_VH.dtype, w_extra_VR.dtype if has_extra else None)
        ctx.mark_non_differentiable(hit_N)
        return loss_sum / count, hit_N

    @staticmethod
    def backward(ctx, grad_loss, _grad_hit):
        (count,) = ctx.saved_tensors
        scale = grad_loss / count
        g_hidden, g_w, g_extra, g_w_extra = ctx.grads
        ctx.grads = None

        def scaled(g, dtype=None):
            if g is None:
                return None
            out = g * scale.to(g.dtype)
            return out if dtype is None else out.to(dtype)

        w_dtype, extra_dtype = ctx.dtypes
        return (
            scaled(g_hidden),
            scaled(g_w, w_dtype),
            scaled(g_extra),
            scaled(g_w_extra, extra_dtype),
            None,
            None,
            None,
        )


def fused_linear_cross_entropy(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    labels_N: torch.Tensor,
    *,
    extra_NR: torch.Tensor | None = None,
    extra_weight_VR: torch.Tensor | None = None,
    chunk_size: int = 4096,
    compile_elementwise: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(mean CE over non-ignored rows, hit_N)` where `hit_N` says the argmax equals the label.

    `compile_elementwise` fuses each chunk's softmax/gradient passes with `torch.compile` (GPU).
    """
    return _FusedLinearCE.apply(
        hidden_NH, weight_VH, extra_NR, extra_weight_VR, labels_N, chunk_size, compile_elementwise
    )


def reference_cross_entropy(logits_NV: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    """Plain CE on materialised logits; the test and benchmark baseline."""
    return F.cross_entropy(logits_NV.float(), labels_N, ignore_index=IGNORE_INDEX)
