"""The plain `vllm serve` command that serves a run's export with its target: a product output.

A run's draft is only useful if it serves outside hpctoolkit. The evaluate role prints this
command and records it in `summary.json` (`serve_command`), and
`tests/e2e/test_vllm_serve_cli.py` runs exactly what it returns, as a subprocess, then asks the
server for completions and reads its speculative-decoding counters. Pure: no vLLM import.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Sequence


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
