"""`inputs.json`: the resolved recipe and the SHA-256 of every input it names, pinned at a run's start.

    {"version": 1,
     "recipe": {"sha256", "yaml"},       the resolved recipe before this host's `auto` precisions
                                         (`recipe.load.load_pinned`): the same text on every host
     "files": {name: {"knob", "what", "sha256", "bytes"}}}   `config.pinned_inputs` says which and how

The first attempt writes it (`pin`, from `ledger.start_attempt`); every later attempt (a requeue,
a by-hand resume) and every role on every node (`roles.context.load_context`) measures its inputs
again (`roles.measure_inputs.measure`) and `check`s them: a changed recipe or file is a `ConfigError`, one
line naming it and both hashes. A file is keyed by its path as the recipe names it (a run's nodes share those paths); an
installed wheel's file by `pypi:` name or `wheel:<distribution>/<file>` (each node has its own
site-packages). A run directory from before this record gets one at its next attempt.

Hashing reads every pinned byte once per role start: the prompt files, configs and tokenizer
files are small next to the weights, which are pinned by size only (`config.pinned_inputs`).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hpctoolkit.config.pinned_inputs import file_change, recipe_change
from hpctoolkit.errors import ConfigError
from hpctoolkit.rundir.atomic import read_json, write_json_atomic
from hpctoolkit.rundir.layout import RunDir

VERSION = 1
CHUNK_BYTES = 16 << 20


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Pin:
    """What this process sees now: the resolved recipe's text and its inputs' records."""

    recipe: str
    files: dict[str, dict[str, Any]] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "recipe": {"sha256": sha256_text(self.recipe), "yaml": self.recipe},
            "files": self.files,
        }


def read_pin(run: RunDir) -> dict[str, Any] | None:
    """The run's `inputs.json`, or None before its first attempt pinned it; `ConfigError` when it
    is there but unreadable (fail closed: nothing would be checked)."""
    if not run.inputs.exists():
        return None
    record = read_json(run.inputs)
    if (
        not isinstance(record, dict)
        or record.get("version") != VERSION
        or not isinstance(record.get("recipe"), dict)
        or not isinstance(record.get("files"), dict)
    ):
        raise ConfigError(
            f"{run.inputs} is unreadable or from another version: it pins the inputs this run started "
            "with; put it back, or start a new run"
        )
    return record


def check(run: RunDir, now: Pin) -> None:
    """Refuse (`ConfigError`, one line) a recipe or input that differs from what `run` pinned at its
    start; nothing to check before the start pinned it."""
    record = read_pin(run)
    if record is None:
        return
    _check(run, record, now)


def _check(run: RunDir, record: dict[str, Any], now: Pin) -> None:
    old_sha, new_sha = str(record["recipe"].get("sha256", "")), sha256_text(now.recipe)
    if old_sha != new_sha:
        why = recipe_change(_tree(record["recipe"].get("yaml", "")), _tree(now.recipe))
        if why is not None:
            raise ConfigError(
                f"the resolved recipe of run {run.run_id} changed since it started: {why} (sha256 "
                f"{old_sha[:12]} at start, {new_sha[:12]} now); resume it with the recipe and overrides "
                f"it started with ({run.inputs} holds them), or start a new run"
            )
    why = file_change(record["files"], now.files)
    if why is not None:
        raise ConfigError(f"run {run.run_id}: {why}")


def _tree(text: str) -> dict[str, Any]:
    tree = yaml.safe_load(text) if text else None
    return tree if isinstance(tree, dict) else {}


def pin(run: RunDir, now: Pin) -> bool:
    """The attempt start's part: pin `now` when `run` has no record yet (True), else check it."""
    record = read_pin(run)
    if record is not None:
        _check(run, record, now)
        return False
    write_json_atomic(run.inputs, now.record(), indent=1, sort_keys=True)
    return True
