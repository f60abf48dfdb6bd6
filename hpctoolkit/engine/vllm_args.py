"""`engine.extra_args` checked against vLLM's own engine arguments, at submission.

The keys go to `vllm.LLM(**kwargs)`, which hands them to `vllm.engine.arg_utils.EngineArgs`; an
unknown one would otherwise fail only when the engine starts, on a node, minutes into the job.
Where vLLM is not importable (a login node without it), the check is skipped and said so: the
submission still goes on, since the nodes (or the container) have their own vLLM.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable

from hpctoolkit.errors import ConfigError


def engine_arg_names() -> frozenset[str] | None:
    """The fields of vLLM's `EngineArgs`; None where vLLM cannot be imported here."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except Exception:  # noqa: BLE001 -- absent, or present but broken here: both mean "cannot check"
        return None
    return frozenset(f.name for f in dataclasses.fields(EngineArgs))


def unknown_keys(keys: Iterable[str], known: frozenset[str]) -> list[str]:
    return sorted(k for k in keys if k not in known)


def check_extra_args(extra: Iterable[str], known: frozenset[str] | None = None) -> str | None:
    """`ConfigError` naming the first key of `extra` that is no vLLM engine argument (with the
    closest names); returns a note when vLLM is not importable and the check was skipped."""
    keys = list(extra)
    if not keys:
        return None
    names = engine_arg_names() if known is None else known
    if names is None:
        return (
            f"note: vLLM is not importable here, so engine.extra_args ({', '.join(sorted(keys))}) "
            "is not checked against its engine arguments; the engine checks them when it starts"
        )
    bad = unknown_keys(keys, names)
    if bad:
        close = difflib.get_close_matches(bad[0], sorted(names), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(
            f"engine.extra_args.{bad[0]} is not an argument of vLLM's EngineArgs"
            f"{hint} (unknown: {', '.join(bad)})"
        )
    return None
