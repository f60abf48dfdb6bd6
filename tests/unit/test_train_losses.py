"""Loss math, normalisation, masking and the target head, on tiny CPU tensors (no processes)."""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hpctoolkit.models.common.losses import acceptance_from_matches, per_position
from hpctoolkit.models.dflash.layout import IGNORE_INDEX
from hpctoolkit.models.dflash.loss import dflash_decay_gamma, dflash_loss, slot_weights
from hpctoolkit.models.dspark.loss import dspark_loss
from hpctoolkit.models.eagle3.loss import eagle3_step_loss, eagle3_target_side
from hpctoolkit.targets.resolve import resolve_target
from hpctoolkit.train.batch import collate
from hpctoolkit.train.build import build_trainer
from hpctoolkit.train.config import TrainingConfig
from hpctoolkit.train.metrics import StepStats
from hpctoolkit.train.synthetic import SyntheticSample, SyntheticSamples
from hpctoolkit.train.target_head import TargetHead

pytestmark = pytest.mark.timeout(120)
RECIPES = "recipes/draft_models"


def test_acceptance_is_the_accepted_prefix():
    match = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    ok = torch.tensor([True, True, True, False])
    reach, chains = acceptance_from_matches(match, ok)
    assert chains == 3
    assert reach.tolist() == [2, 2, 1, 1]  # chains reaching depth k: [1,1,0,..], [0..], [1,1,1,1]
    v = torch.cat([torch.zeros(2 + 4 * 4), reach, chains.reshape(1)]).double()
    v[0] = 1.0
    s = StepStats(4, (), v)
    assert s.simulated_acc_len_excl_bonus() == pytest.approx(6 / 3)
    assert s.acceptance_length_incl_bonus() == pytest.approx(1 + 6 / 3)
    assert s.acceptance_length_incl_bonus(max_drafts=2) == pytest.approx(1 + 4 / 3)


def test_dflash_decay_weights_and_weighted_ce():
    assert (
        dflash_decay_gamma(16) == 7.0 and dflash_decay_gamma(4) == 2.0 and dflash_decay_gamma(4, 3.0) == 3.0
    )
    w = slot_weights(4, 2.0, torch.device("cpu"))
    assert w.tolist() == pytest.approx([0.0, 1.0, math.exp(-0.5), math.exp(-1.0)])
    g = torch.Generator().manual_seed(0)
    B, N, K, H, V = 2, 3, 4, 8, 11
    hidden = torch.randn(B, N * K, H, generator=g)
    W = torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (B, N * K), generator=g)
    labels[:, ::K] = IGNORE_INDEX
    labels[1, 5] = IGNORE_INDEX
    rows = torch.randn(B, N * K, H, generator=g)
    parts = dflash_loss(
        hidden,
        W,
        lambda r: r @ W.T,
        rows,
        labels,
        torch.ones(B, N, dtype=torch.bool),
        block_size=K,
        gamma=2.0,
    )
    ce = F.cross_entropy(
        (hidden @ W.T).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    wt = w.repeat(N).repeat(B) * (labels.flatten() != IGNORE_INDEX)
    assert float(parts.numerator) == pytest.approx(float((ce * wt).sum()), rel=1e-6)
    assert float(parts.denominator) == pytest.approx(float(wt.sum()), rel=1e-6)
    assert parts.pos_count.tolist() == [5, 6, 6]  # labels[1, 5] is block 1, slot 1


def test_dspark_loss_terms_match_the_formula():
    g = torch.Generator().manual_seed(1)
    B, N, K, H, R, V = 1, 2, 3, 6, 2, 9
    hidden = torch.randn(B, N * K, H, generator=g)
    markov = torch.randn(B, N * K, R, generator=g)
    W, W2 = torch.randn(V, H, generator=g), torch.randn(V, R, generator=g)
    conf = torch.randn(B, N * K, generator=g)
    tgt_W = torch.randn(V, H, generator=g)
    rows = torch.randn(B, N * K, H, generator=g)
    labels = torch.randint(0, V, (B, N * K), generator=g)
    labels[:, ::K] = IGNORE_INDEX
    parts = dspark_loss(
        hidden,
        markov,
        W,
        W2,
        conf,
        lambda r: r @ tgt_W.T,
        rows,
        labels,
        torch.ones(B, N, dtype=torch.bool),
        block_size=K,
    )
    logits = (hidden @ W.T + markov @ W2.T).flatten(0, 1)
    p, q = logits.softmax(-1), (rows @ tgt_W.T).flatten(0, 1).softmax(-1)
    l1 = (p - q).abs().sum(-1)
    ce = F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    bce = F.binary_cross_entropy_with_logits(conf.flatten(), 1 - 0.5 * l1, reduction="none")
    k = torch.arange(K).repeat(N)
    w = torch.where(k > 0, torch.exp(-(k - 1) / 4.0), torch.zeros(()))
    per = 0.1 * ce + 0.9 * l1 + 1.0 * bce
    assert float(parts.numerator) == pytest.approx(float((per * w).sum()), rel=1e-5)
    assert float(parts.denominator) == pytest.approx(float(w.sum()), rel=1e-6)
    assert float(parts.extras["l1"]) == pytest.approx(float((l1 * w).sum()), rel=1e-5)


def _dspark_autograd_reference(hidden, markov, W, W2, conf, tgt_W, rows, labels, K):
    """The DSpark loss written plainly with autograd: full logits, no fusion, no dropped rows."""
    logits = (hidden @ W.T + markov @ W2.T).flatten(0, 1)
    q = (rows @ tgt_W.T).flatten(0, 1).softmax(-1)
    l1 = (logits.softmax(-1) - q).abs().sum(-1)
    ce = F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    bce = F.binary_cross_entropy_with_logits(conf.flatten(), (1 - 0.5 * l1.detach()), reduction="none")
    k = torch.arange(K).repeat(labels.numel() // K)
    w = torch.where(k > 0, torch.exp(-(k - 1) / 4.0), torch.zeros(())) * (labels.flatten() != IGNORE_INDEX)
    return ((0.1 * ce + 0.9 * l1 + 1.0 * bce) * w).sum()


@pytest.mark.parametrize("chunk_rows", [3, 1000])
def test_fused_dspark_loss_gradients_match_autograd(chunk_rows):
    """The fused CE+L1 (gradients formed in forward, anchor rows skipped) against plain autograd."""
    g = torch.Generator().manual_seed(2)
    B, N, K, H, R, V = 2, 3, 4, 6, 3, 13
    leaves = {
        "hidden": torch.randn(B, N * K, H, generator=g),
        "markov": torch.randn(B, N * K, R, generator=g),
        "W": torch.randn(V, H, generator=g),
        "W2": torch.randn(V, R, generator=g),
        "conf": torch.randn(B, N * K, generator=g),
    }
    tgt_W = torch.randn(V, H, generator=g)
    rows = torch.randn(B, N * K, H, generator=g)
    labels = torch.randint(0, V, (B, N * K), generator=g)
    labels[:, ::K] = IGNORE_INDEX
    labels[1, 5] = IGNORE_INDEX
    grads = {}
    for arm in ("fused", "reference"):
        x = {k: v.clone().double().requires_grad_() for k, v in leaves.items()}
        if arm == "fused":
            loss = dspark_loss(
                x["hidden"],
                x["markov"],
                x["W"],
                x["W2"],
                x["conf"],
                lambda r: r @ tgt_W.double().T,
                rows.double(),
                labels,
                torch.ones(B, N, dtype=torch.bool),
                block_size=K,
                chunk_rows=chunk_rows,
            ).numerator
        else:
            loss = _dspark_autograd_reference(
                x["hidden"], x["markov"], x["W"], x["W2"], x["conf"], tgt_W.double(), rows.double(), labels, K
            )
        (loss * 3.0).backward()
        grads[arm] = (loss.detach(), {k: v.grad for k, v in x.items()})
    torch.testing.assert_close(grads["fused"][0], grads["reference"][0], rtol=1e-7, atol=1e-9)
    for name, ref in grads["reference"][1].items():
        torch.testing.assert_close(grads["fused"][1][name], ref, rtol=1e-7, atol=1e-9, msg=name)


@pytest.mark.parametrize("chunk_rows", [3, 1000])
@pytest.mark.parametrize("from_target", [False, True])
def test_fused_dflash_loss_gradients_match_autograd(chunk_rows, from_target):
    """The fused CE (gradients formed in forward, anchor rows skipped, target argmax formed in the
    same chunk) against plain autograd on full logits, in fp64: loss, gradients and the chain
    statistics scored against the target's argmax."""
    g = torch.Generator().manual_seed(4)
    B, N, K, H, V = 2, 3, 4, 6, 13
    hidden0 = torch.randn(B, N * K, H, generator=g).double()
    W0 = torch.randn(V, H, generator=g).double()
    tgt_W = torch.randn(V, H, generator=g).double()
    rows = torch.randn(B, N * K, H, generator=g).double()
    labels = torch.randint(0, V, (B, N * K), generator=g)
    labels[:, ::K] = IGNORE_INDEX
    labels[1, 5] = IGNORE_INDEX
    ok = torch.tensor([[True, True, False], [True, True, True]])
    tgt_ids = (rows @ tgt_W.T).argmax(-1)
    ref_labels = torch.where(labels != IGNORE_INDEX, tgt_ids, labels) if from_target else labels
    arms = {}
    for arm in ("fused", "reference"):
        hidden, W = hidden0.clone().requires_grad_(), W0.clone().requires_grad_()
        if arm == "fused":
            parts = dflash_loss(
                hidden,
                W,
                lambda r: r @ tgt_W.T,
                rows,
                labels,
                ok,
                block_size=K,
                gamma=2.0,
                chunk_rows=chunk_rows,
                labels_from_target=from_target,
            )
            loss = parts.numerator
            stats = {n: getattr(parts, n) for n in ("pos_correct", "pos_count", "reach", "chains")}
        else:
            logits = (hidden @ W.T).flatten(0, 1)
            ce = F.cross_entropy(logits, ref_labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
            k = torch.arange(K).repeat(B * N)
            w = torch.where(k > 0, torch.exp(-(k - 1) / 2.0), 0.0) * (ref_labels.flatten() != IGNORE_INDEX)
            loss = (ce * w).sum()
            match = (logits.argmax(-1) == tgt_ids.flatten()).view(B * N, K)[:, 1:]
            mask = (ref_labels != IGNORE_INDEX).view(B * N, K)[:, 1:] & ok.reshape(-1, 1)
            correct, count = per_position(match, mask)
            reach, chains = acceptance_from_matches(match, ok.reshape(-1))
            stats = (correct, count, reach, chains)
        (loss * 3.0).backward()
        arms[arm] = (loss.detach(), hidden.grad, W.grad, stats)
    (lf, hf, wf, sf), (lr, hr, wr, (correct, count, reach, chains)) = arms["fused"], arms["reference"]
    torch.testing.assert_close(lf, lr, rtol=1e-12, atol=0)
    torch.testing.assert_close(hf, hr, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(wf, wr, rtol=1e-10, atol=1e-14)
    for name, ref in (("pos_correct", correct), ("pos_count", count), ("reach", reach), ("chains", chains)):
        torch.testing.assert_close(sf[name].double(), ref.double(), msg=name)


def test_eagle3_masks_positions_whose_target_argmax_is_outside_the_draft_vocab():
    H, V = 4, 6
    draft_ids = torch.tensor([0, 2, 4])
    tgt_W = torch.eye(V, H) * 10  # row v peaks on hidden dim v (v < H)
    rows = torch.zeros(3, H)
    rows[0, 2] = 1  # target argmax 2: in the draft vocab
    rows[1, 1] = 1  # target argmax 1: outside
    rows[2, 0] = 1  # target argmax 0: in
    hidden = torch.randn(3, H, requires_grad=True)
    logp_t, argmax, inside = eagle3_target_side(lambda r: r @ tgt_W.T, rows, draft_ids)
    assert argmax.tolist() == [2, 1, 0] and logp_t.shape == (3, 3)
    kl, match, sup = eagle3_step_loss(
        hidden, torch.randn(3, H), logp_t, argmax, inside, torch.ones(3, dtype=torch.bool), draft_ids
    )
    assert sup.tolist() == [True, False, True]
    assert float(kl[1].detach()) == 0.0 and bool(match[1]) is False
    kl.sum().backward()
    assert hidden.grad[1].abs().sum() == 0


def test_short_sample_is_zero_weighted_not_dropped():
    src = SyntheticSamples(4, 512, 128, 3, lengths=[40, 10, 33, 24], seed=3)
    samples = [src.sample(i) for i in range(4)]
    batch = collate(samples, max_seq_len=64, min_loss_tokens=14)
    assert batch.batch_size == 4 and batch.weight_B.tolist() == [1.0, 0.0, 1.0, 1.0]
    tr = build_trainer(
        f"{RECIPES}/tiny_dspark.json", resolve_target("builtin:tiny-qwen3"), TrainingConfig(num_anchors=4)
    )
    with_short = tr.run(batch, step=0)
    without = tr.run(collate([samples[i] for i in (0, 2, 3)], max_seq_len=64, min_loss_tokens=14), step=0)
    assert float(with_short.numerator) == pytest.approx(float(without.numerator), rel=1e-5)
    assert float(with_short.denominator) == pytest.approx(float(without.denominator), rel=1e-6)


@pytest.mark.parametrize(("name", "default"), [("tiny_dflash.json", 2.0), ("tiny_dspark.json", 4.0)])
def test_the_slot_decay_is_the_draft_configs_decay_gamma(name, default):
    """`decay_gamma` is the family's own config key (0: the family's default); a negative is refused."""
    import json

    from hpctoolkit.errors import ConfigError
    from hpctoolkit.models.registry import config_from_dict

    src = SyntheticSamples(2, 512, 128, 3, lengths=[40, 33], seed=3)
    batch = collate([src.sample(i) for i in range(2)], max_seq_len=64, min_loss_tokens=14)
    target = resolve_target("builtin:tiny-qwen3")
    data = json.loads(Path(RECIPES, name).read_text())
    denominators = []
    for gamma in (0.0, default, 1.5):
        tr = build_trainer(
            config_from_dict({**data, "decay_gamma": gamma}), target, TrainingConfig(num_anchors=4)
        )
        denominators.append(float(tr.run(batch, step=0).denominator))
    assert denominators[0] == denominators[1] != denominators[2]
    with pytest.raises(ConfigError, match=r"decay_gamma=-1.0 must be >= 0"):
        config_from_dict({**data, "decay_gamma": -1.0})


def test_global_normalisation_is_split_invariant_in_process():
    """sum(numerators) / sum(denominators) over any split of a batch equals the whole batch's.

    The second sample is too short (zero-weighted), so the halves' denominators differ.
    """
    src = SyntheticSamples(4, 512, 128, 3, lengths=[40, 10, 33, 24], seed=5)
    samples = [src.sample(i) for i in range(4)]
    tr = build_trainer(
        f"{RECIPES}/tiny_dspark.json", resolve_target("builtin:tiny-qwen3"), TrainingConfig(num_anchors=4)
    )
    whole = tr.run(collate(samples, max_seq_len=64, min_loss_tokens=14), step=3)
    halves = [tr.run(collate(samples[i : i + 2], max_seq_len=64, min_loss_tokens=14), step=3) for i in (0, 2)]
    glob = sum(float(h.numerator) for h in halves) / sum(float(h.denominator) for h in halves)
    assert glob == pytest.approx(float(whole.numerator) / float(whole.denominator), rel=1e-5)
    naive = sum(float(h.numerator) / float(h.denominator) for h in halves) / 2
    assert abs(naive - glob) > 1e-4, "the split should make a per-rank mean differ, or the test has no teeth"


def test_target_head_reads_only_head_tensors_and_matches_transformers():
    from transformers import AutoModelForCausalLM

    target = resolve_target("builtin:tiny-qwen3")
    head = TargetHead.from_pretrained(target)
    assert tuple(head.lm_head_VH.shape) == (512, 128)
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    grabbed = {}
    model.model.norm.register_forward_hook(lambda m, a, o: grabbed.__setitem__("pre", a[0]))
    ids = torch.tensor([[5, 17, 300, 42, 7]])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    torch.testing.assert_close(
        head.logits(grabbed["pre"][0], prenorm=True), out.logits[0], rtol=1e-4, atol=1e-3
    )
    torch.testing.assert_close(
        head.logits(out.hidden_states[-1][0], prenorm=False), out.logits[0], rtol=1e-4, atol=1e-3
    )


def test_collate_rejects_mixed_capture_conventions():
    from hpctoolkit.errors import DataIntegrityError

    a = SyntheticSample("a", torch.zeros(4, dtype=torch.long), torch.zeros(1, 4, 8), torch.zeros(4, 8))
    b = SyntheticSample(
        "b",
        torch.zeros(4, dtype=torch.long),
        torch.zeros(1, 4, 8),
        torch.zeros(4, 8),
        manifest={"extra": {"last_hidden_states_prenorm": False}},
    )
    with pytest.raises(DataIntegrityError, match="prenorm"):
        collate([a, b], max_seq_len=8, min_loss_tokens=1)
