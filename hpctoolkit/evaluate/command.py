"""The plain `vllm serve` command that serves a run's export with its target: a product output.

A run's draft is only useful if it serves outside hpctoolkit. The evaluate role prints this
command and records it in `summary.json` (`serve_command`), and
`tests/e2e/test_vllm_serve_cli.py` runs exactly what it returns, as a subprocess, then asks the
server for completions and reads its speculative-decoding counters. Pure: no vLLM import.

`k_warning` is the one line said wherever hpctoolkit serves a draft or prints this command at a
k past the depth the draft was trained for (`models.families.trained_depth`); a warning, not an
error, since measuring a draft past its depth is a fair question.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Sequence
from typing import Any

from hpctoolkit.models.families import read_config_json, serving_for, trained_depth


def serve_argv(
    export_dir: str | os.PathLike[str],
    target_dir: str | os.PathLike[str],
    *,
    method: str,
    num_speculative_tokens: int,
    extra: Sequence[str] = (),
) -> list[str]:
    """`vllm serve TARGET --speculative-config {...}` for the export in `export_dir`, drafting
    `num_speculative_tokens` tokens a step with vLLM's `method` (the family's
    `Serving.vllm_method`). `extra`: further `vllm serve` flags (host, port, lengths)."""
    if num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be at least 1, got {num_speculative_tokens}")
    spec = {
        "method": method,
        "model": os.fspath(export_dir),
        "num_speculative_tokens": num_speculative_tokens,
    }
    return [
        "vllm",
        "serve",
        os.fspath(target_dir),
        "--speculative-config",
        json.dumps(spec, separators=(",", ":")),
        *extra,
    ]


def serve_line(argv: Sequence[str]) -> str:
    """`argv` as one line a shell runs as it is (the JSON quoted)."""
    return shlex.join(argv)


def k_warning(draft: Any, num_speculative_tokens: int, *, ttt_length: int | None = None) -> str | None:
    """Why serving the draft of `draft` (a `config.json` dict or path, the recipe's draft config or
    the export's) at k = `num_speculative_tokens` wastes verification, or None where k is within
    the depth it was trained for, or that depth is unknown (`families.trained_depth`; `ttt_length`:
    the run's `training.ttt_length`, which Eagle3's depth is). The message, without a prefix: the
    caller says it in its own form."""
    if isinstance(draft, (str, os.PathLike)):
        draft = read_config_json(draft)
    trained = trained_depth(draft, ttt_length=ttt_length)
    k = num_speculative_tokens
    if trained is None or k <= trained.depth:
        return None
    d = trained.depth
    return (
        f"serving k={k} speculative tokens with the {serving_for(draft).title} draft, trained for {d} "
        f"({trained.source}): positions past {d} were never trained"
    )
