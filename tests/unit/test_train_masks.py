"""Every draft family trains only on supervised tokens (the sample's loss mask): Eagle3's TTT
targets, DFlash and DSpark anchors only where a whole block is supervised; the supervised-token
count; the Eagle3 vocabulary from supervised tokens only, saved and reused."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hpctoolkit.models.dflash.trainer import block_supervised
from hpctoolkit.targets.resolve import resolve_target
from hpctoolkit.train.batch import collate
from hpctoolkit.train.build import build_trainer
from hpctoolkit.train.config import TrainingConfig
from hpctoolkit.train.synthetic import SyntheticSamples

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "draft_models"
pytestmark = pytest.mark.timeout(300)


def masked_samples(lengths, spans, seed=1):
    src = SyntheticSamples(len(lengths), 512, 128, 3, lengths=lengths, seed=seed)
    out = []
    for i, (lo, hi) in enumerate(spans):
        s = src.sample(i)
        mask = torch.zeros(s.input_ids.shape[0], dtype=torch.uint8)
        mask[lo:hi] = 1
        out.append(
            SimpleNamespace(
                key=s.key,
                input_ids=s.input_ids,
                aux_hidden_states=s.aux_hidden_states,
                last_hidden_states=s.last_hidden_states,
                manifest=None,
                loss_mask=mask,
            )
        )
    return out


def test_collate_carries_the_mask_and_counts_supervised_tokens():
    samples = masked_samples([40, 30], [(10, 25), (5, 30)])
    b = collate(samples, max_seq_len=64, min_loss_tokens=14)
    assert b.supervised_BS[0].nonzero().flatten().tolist() == list(range(10, 25))
    assert b.supervised_tokens == 15 + 25
    plain = SyntheticSamples(2, 512, 128, 3, lengths=[40, 30], seed=1)
    b2 = collate([plain.sample(0), plain.sample(1)], max_seq_len=64, min_loss_tokens=14)
    assert b2.supervised_tokens == 70  # no mask: every real token


def test_block_supervised_needs_every_predicted_token():
    sup = torch.zeros(1, 12, dtype=torch.bool)
    sup[0, 3:8] = True
    # K=3: anchor a predicts a+1, a+2.
    assert block_supervised(sup, 3)[0].nonzero().flatten().tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("family", ["dflash", "dspark"])
def test_block_families_draw_anchors_only_in_supervised_blocks(family):
    tr = build_trainer(
        f"{RECIPES}/tiny_{family}.json", resolve_target("builtin:tiny-qwen3"), TrainingConfig(num_anchors=4)
    )
    samples = masked_samples([48, 48], [(20, 40), (0, 48)])
    batch = collate(samples, max_seq_len=64, min_loss_tokens=14)
    K = tr.block_size
    for step in range(5):
        st = tr.step_inputs(batch, step)
        assert st["anchor_ok_BN"][0].any()
        for a, ok in zip(st["anchors_BN"][0].tolist(), st["anchor_ok_BN"][0].tolist(), strict=True):
            if ok:
                assert a + 1 >= 20 and a + K - 1 < 40


@pytest.mark.parametrize("family", ["dflash", "dspark", "eagle3"])
def test_targets_of_unsupervised_tokens_do_not_change_the_loss(family):
    """The target row at position r supervises token r + 1: perturbing the rows of unsupervised
    tokens leaves the loss unchanged, perturbing a supervised one changes it."""
    tr = build_trainer(
        f"{RECIPES}/tiny_{family}.json", resolve_target("builtin:tiny-qwen3"), TrainingConfig(num_anchors=4)
    )
    samples = masked_samples([48], [(20, 40)])
    base = tr.run(collate(samples, max_seq_len=64, min_loss_tokens=14), step=0)
    assert float(base.denominator) > 0
    s = samples[0]
    last = s.last_hidden_states.clone()
    rows_out = [r for r in range(48) if not (20 <= r + 1 < 40)]
    last[rows_out] = torch.randn(len(rows_out), last.shape[1]) * 5
    moved = SimpleNamespace(**{**vars(s), "last_hidden_states": last})
    other = tr.run(collate([moved], max_seq_len=64, min_loss_tokens=14), step=0)
    assert float(other.numerator.detach()) == pytest.approx(float(base.numerator.detach()), rel=1e-5)
    assert float(other.denominator) == pytest.approx(float(base.denominator))
    last2 = s.last_hidden_states.clone()
    last2[20:39] = torch.randn(19, last.shape[1]) * 5
    inside = SimpleNamespace(**{**vars(s), "last_hidden_states": last2})
    assert float(
        tr.run(collate([inside], max_seq_len=64, min_loss_tokens=14), step=0).numerator.detach()
    ) != pytest.approx(float(base.numerator.detach()), rel=1e-5)


def test_eagle3_vocabulary_counts_supervised_tokens_only_and_is_saved_and_reused(tmp_path):
    from hpctoolkit.models.common.vocab import supervised_token_counts
    from hpctoolkit.train.loop import DRAFT_VOCAB_FILE, _save_vocab, _saved_vocab_counts

    s = SimpleNamespace(
        input_ids=torch.tensor([5, 5, 7, 9, 9, 9]), loss_mask=torch.tensor([0, 0, 1, 1, 0, 1])
    )
    counts = supervised_token_counts(s, 16)
    assert counts[5] == 0 and counts[7] == 1 and counts[9] == 2 and counts.sum() == 3
    cfg = json.loads((RECIPES / "tiny_eagle3.json").read_text())
    V, D = cfg["vocab_size"], cfg["draft_vocab_size"]
    assert D < V, "the tiny Eagle3 draft prunes its vocabulary"
    want = torch.zeros(V, dtype=torch.float64)
    want[torch.arange(V - D, V)] = 3.0  # the top ids only
    tr = build_trainer(
        str(RECIPES / "tiny_eagle3.json"),
        resolve_target("builtin:tiny-qwen3"),
        TrainingConfig(),
        vocab_counts=want,
    )
    _save_vocab(tr, tmp_path, "test")
    saved = json.loads((tmp_path / DRAFT_VOCAB_FILE).read_text())
    assert saved["target_ids"] == list(range(V - D, V)) and saved["vocab_size"] == V
    again = build_trainer(
        str(RECIPES / "tiny_eagle3.json"),
        resolve_target("builtin:tiny-qwen3"),
        TrainingConfig(),
        vocab_counts=_saved_vocab_counts(str(tmp_path / DRAFT_VOCAB_FILE), V, D),
    )
    assert torch.equal(again.draft.d2t, tr.draft.d2t)
    from hpctoolkit.errors import ConfigError

    with pytest.raises(ConfigError, match="this draft needs"):
        _saved_vocab_counts(str(tmp_path / DRAFT_VOCAB_FILE), V, D - 1)
