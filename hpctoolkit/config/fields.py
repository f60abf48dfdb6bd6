"""Small helpers that section configs use to check their own fields.

Every check raises `ConfigError` naming the key relative to its section; the recipe loader adds the
section prefix, so the user sees `store.kv_lease_ttl_s must be > 0, got -1`.
"""

from __future__ import annotations

import re
from typing import Any

from hpctoolkit.errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def require(cond: bool, key: str, why: str, value: Any) -> None:
    if not cond:
        raise ConfigError(f"{key} {why}, got {value!r}")


def positive(obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        require(v is not None and v > 0, n, "must be > 0", v)


def non_negative(obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        require(v is not None and v >= 0, n, "must be >= 0", v)


def one_of(obj: Any, name: str, choices: tuple[str, ...]) -> None:
    v = getattr(obj, name)
    require(v in choices, name, f"must be one of {list(choices)}", v)


def parse_size(text: str | int, key: str) -> int:
    """Bytes from `512MB`, `4GiB`, `1g` or a plain integer."""
    if isinstance(text, int):
        require(text > 0, key, "must be a positive size", text)
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(f"{key} must be a size like 512MB or 4GB, got {text!r}")
    unit = m.group(2).upper().replace("I", "").rstrip("B") or ""
    n = int(float(m.group(1)) * _UNITS[unit])
    require(n > 0, key, "must be a positive size", text)
    return n
