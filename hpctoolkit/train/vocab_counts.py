"""The pruned vocabulary of a live run, chosen from the engines' counts of the supervised tokens.

A live store hands each sample out once, so the trainers cannot count the tokens first: each
engine writes its counts (`run.vocab_counts(engine)`), and every rank chooses the same ids from
them and writes the same `manifests/draft_vocab.json`.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from hpctoolkit.errors import ConfigError, DataIntegrityError
from hpctoolkit.models.common.vocab import draft_vocab_from_counts
from hpctoolkit.models.registry import load_draft_config
from hpctoolkit.output.console import speaker
from hpctoolkit.rundir.atomic import read_json, write_json_atomic
from hpctoolkit.rundir.layout import RunDir
from hpctoolkit.train.build import needs_vocab_counts

say = speaker("trainer")


def counted_vocab(
    cfg: Any, run: RunDir, prefixes: Sequence[str], stall_timeout_s: float, *, announce: bool = False
) -> Any:
    """`cfg`, with `data.draft_vocab` set to the pruned vocabulary chosen from the engines' counts
    of every sample's supervised tokens when the draft prunes its vocabulary and the recipe names
    none. Each engine's counts are waited for at most `stall_timeout_s` (as its queue is)."""
    draft = load_draft_config(cfg.draft.config)
    if cfg.data.draft_vocab or not needs_vocab_counts(draft):
        return cfg
    total: Counter[int] = Counter()
    samples = 0
    for engine, prefix in enumerate(prefixes):
        rec = _wait_vocab_counts(run, engine, prefix, stall_timeout_s)
        samples += int(rec["samples"])
        total.update({int(k): int(v) for k, v in rec["counts"].items()})
    counts = torch.zeros(draft.vocab_size, dtype=torch.float64)
    if total:
        ids = torch.tensor(list(total), dtype=torch.long)
        if int(ids.max()) >= draft.vocab_size:
            raise ConfigError(
                f"the engines counted token id {int(ids.max())}, outside the draft's vocab_size={draft.vocab_size}"
            )
        counts[ids] = torch.tensor(list(total.values()), dtype=torch.float64)
    chosen = draft_vocab_from_counts(counts, draft.draft_vocab_size)
    body = {
        "vocab_size": draft.vocab_size,
        "draft_vocab_size": draft.draft_vocab_size,
        "source": f"the engines' counts of the supervised tokens of all {samples} samples",
        "target_ids": chosen.tolist(),
    }
    write_json_atomic(run.engine_vocab, body)  # every rank writes the same ids
    if announce:
        say(f"pruned vocabulary: {draft.draft_vocab_size} of {draft.vocab_size} ids from {body['source']}")
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, draft_vocab=str(run.engine_vocab)))


def _wait_vocab_counts(run: RunDir, engine: int, prefix: str, timeout_s: float) -> dict[str, Any]:
    """Engine `engine`'s counts of this attempt (bounded as the queues are; its failure named)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rec = read_json(run.vocab_counts(engine))
        if isinstance(rec, dict) and rec.get("run_prefix") == prefix:
            return rec
        failed = read_json(run.queue_failed(engine))
        if isinstance(failed, dict) and failed.get("run_prefix") == prefix:
            raise DataIntegrityError(
                f"engine {engine} failed before it counted its samples: {failed.get('error')}"
            )
        if time.monotonic() > deadline:
            raise DataIntegrityError(
                f"{run.vocab_counts(engine)} did not appear within {timeout_s:.0f}s "
                "(the pruned vocabulary is chosen from it)"
            )
        time.sleep(0.5)
