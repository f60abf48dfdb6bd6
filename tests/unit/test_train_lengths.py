"""A compiled trainer's batch lengths: padded to a few fixed lengths (`batch.padded_length`), which
changes no loss, so that the compiled layers (static shapes) meet few shapes and never pass torch's
recompile limit, past which a new length ran eager (found 2026-12-05: a run on real data left
compiled code after its eighth batch length)."""

from __future__ import annotations

import logging

import pytest

from hpctoolkit.train.batch import LENGTH_ALIGN, collate, length_step, padded_length

RECIPES = "recipes/draft_models"


@pytest.mark.parametrize("lengths", [1, 2, 3, 8, 16, 64])
def test_padded_lengths_are_few_cover_the_batch_and_waste_under_a_step(lengths):
    for max_seq_len in [*range(1, 300), 511, 512, 768, 4096, 65536, 131072]:
        step = length_step(max_seq_len, lengths)
        assert step % LENGTH_ALIGN == 0 and step >= max_seq_len / lengths
        got = set()
        for longest in {*range(1, min(max_seq_len, 2000) + 1), max_seq_len - 1, max_seq_len}:
            if longest < 1:
                continue
            n = padded_length(longest, max_seq_len, step)
            assert longest <= n <= max_seq_len
            assert n - longest < step
            assert n % step == 0 or n == max_seq_len
            got.add(n)
        if max_seq_len <= 2000:
            assert len(got) <= lengths + 1, (max_seq_len, sorted(got))
    assert padded_length(37, 100, 1) == 37  # step 1: the longest sample, as without compile


@pytest.mark.parametrize("family", ["tiny_dflash", "tiny_dspark", "tiny_eagle3"])
def test_padding_past_the_longest_sample_changes_no_loss(family):
    from hpctoolkit.targets.resolve import resolve_target
    from hpctoolkit.train.build import build_trainer
    from hpctoolkit.train.config import TrainingConfig
    from hpctoolkit.train.synthetic import SyntheticSamples

    src = SyntheticSamples(4, 512, 128, 3, lengths=[40, 10, 33, 24], seed=3)
    samples = [src.sample(i) for i in range(4)]
    tr = build_trainer(
        f"{RECIPES}/{family}.json", resolve_target("builtin:tiny-qwen3"), TrainingConfig(num_anchors=4)
    )
    got = []
    for step in (1, 16, 64):
        batch = collate(samples, max_seq_len=128, min_loss_tokens=14, step=step)
        parts = tr.run(batch, step=0)
        got.append((batch.input_ids_BS.shape[1], float(parts.numerator), float(parts.denominator)))
    assert [s for s, _, _ in got] == [40, 48, 64]
    for _, num, den in got[1:]:
        assert num == pytest.approx(got[0][1], rel=1e-6) and den == pytest.approx(got[0][2], rel=1e-6)


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.timeout(600)
def test_a_compiled_trainer_stays_compiled_over_many_sample_lengths(tmp_path, monkeypatch):
    """30 steps of one sample each, lengths 16-200 (more than 8 distinct): torch never reports
    its recompile limit, past which it would run the layers eager."""
    from test_train_run import _recipe

    from hpctoolkit.train.run import train
    from hpctoolkit.train.synthetic import SyntheticSamples

    monkeypatch.setenv("HPCTOOLKIT_MIN_STEP_S", "0")
    cfg = _recipe("tiny_dflash", tmp_path, steps=30, progress_every_s=1000, checkpoint_every=30)
    cfg.training.export = False
    cfg.training.compile = "on"
    cfg.training.batch_size = 1
    src = SyntheticSamples(
        num_samples=64, vocab_size=512, hidden_size=128, num_aux=3, seed=2, min_len=16, max_len=200
    )
    lengths = {int(src.sample(i).input_ids.shape[0]) for i in range(30)}
    assert len(lengths) > 8, "the test needs more lengths than torch's default recompile limit"
    seen = _Warnings()
    logging.getLogger("torch._dynamo").addHandler(seen)
    try:
        train(cfg, src, tmp_path / "out")
    finally:
        logging.getLogger("torch._dynamo").removeHandler(seen)
    assert not [x for x in seen.lines if "recompile_limit" in x], seen.lines
