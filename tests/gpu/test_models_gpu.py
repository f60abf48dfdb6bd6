"""GPU checks of the draft models' fast paths (skipped without CUDA; run on the H200 machine).

    python -m pytest tests/gpu/test_models_gpu.py -q

The CPU suite checks flex against sdpa on eager FlexAttention; these check the compiled Triton
kernels with the tuned kernel options (`flex_kernel_options`) and the compiled block-mask build,
at the K3 MLA head dims, against dense sdpa.
"""

from pathlib import Path

import pytest
import torch

from hpctoolkit.models.common.attention import attend, flex_kernel_options
from hpctoolkit.models.dflash.layout import make_block_layout, sample_anchors
from hpctoolkit.models.dspark.loss import dspark_ce_loss
from hpctoolkit.models.registry import build_draft_model, load_draft_config

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "draft_models"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _layout(B: int, S: int, blocks: int, device: torch.device):
    gen = torch.Generator().manual_seed(0)
    anchors, valid = sample_anchors(torch.ones(B, S), blocks, 7, generator=gen)
    return make_block_layout(anchors.to(device), 7, S, valid.to(device))


def test_tuned_flex_matches_dense_sdpa_at_mla_head_dims():
    """bf16 flex (tuned options where they apply) vs an fp32 dense-mask sdpa, forward and grads."""
    dev = torch.device("cuda")
    B, H, S = 2, 8, 1024
    layout = _layout(B, S, 96, dev)
    mask = layout.attention_mask()
    Q, K = layout.draft_len, S + layout.draft_len
    torch.manual_seed(0)
    q = torch.randn(B, H, Q, 192, device=dev)
    k = torch.randn(B, H, K, 192, device=dev)
    v = torch.randn(B, H, K, 128, device=dev)
    g = torch.randn(B, H, Q, 128, device=dev)
    if torch.cuda.get_device_capability() == (9, 0):
        assert flex_kernel_options(q.bfloat16(), v.bfloat16()) is not None
    outs, grads = {}, {}
    for backend, dtype in (("flex", torch.bfloat16), ("sdpa", torch.float32)):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = attend(*leaves, mask, scale=192**-0.5, backend=backend)
        out.backward(g.to(dtype))
        outs[backend] = out.float()
        grads[backend] = [t.grad.float() for t in leaves]
    torch.testing.assert_close(outs["flex"], outs["sdpa"], rtol=2e-2, atol=2e-2)
    for got, ref in zip(grads["flex"], grads["sdpa"], strict=True):
        torch.testing.assert_close(got, ref, rtol=5e-2, atol=5e-2)


def test_k3_draft_step_flex_compiled_matches_sdpa_eager():
    """The tiny K3 DSpark MLA draft: loss and every gradient agree between the benchmark's fast
    path (flex, compiled layers, compiled CE elementwise) and plain eager sdpa, in float32."""
    dev = torch.device("cuda")
    config = load_draft_config(RECIPES / "tiny_k3_dspark_mla.json")
    torch.manual_seed(0)
    with torch.device(dev):
        model = build_draft_model(config)
    B, S = 2, 256
    layout = _layout(B, S, 24, dev)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size - 2, (B, S), generator=gen).to(dev)
    ctx = torch.randn(B, S, config.num_target_layers * config.target_hidden_size, generator=gen).to(dev)
    labels = layout.labels(ids)
    results = {}
    for variant in ("sdpa", "flex"):
        model.zero_grad(set_to_none=True)
        model.set_attention_backend(variant)
        if variant == "flex":
            model.compile_layers()
        out = model(ctx, ids, layout)
        loss = dspark_ce_loss(model, out, labels, chunk_size=64, compile_elementwise=variant == "flex").total
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[variant] = (loss.detach(), grads)
    (l_ref, g_ref), (l_got, g_got) = results["sdpa"], results["flex"]
    torch.testing.assert_close(l_got, l_ref, rtol=1e-4, atol=1e-5)
    assert g_got.keys() == g_ref.keys() and "layers.0.self_attn.q_a_proj.weight" in g_ref
    for name, ref in g_ref.items():
        torch.testing.assert_close(g_got[name], ref, rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
