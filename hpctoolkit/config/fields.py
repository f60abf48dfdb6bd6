"""What each recipe field accepts: one declarative kind per field, and the helpers section configs
use for their cross-field rules.

Every section config (and every dataclass nested in one) declares `KINDS: ClassVar[dict[str, Kind]]`,
one entry per field. `check_fields(section)` walks the fields and checks each value against its kind
before the section's own `validate()` runs its cross-field rules; `tests/unit/test_config_fields.py`
fails when a field has no kind, so a new field gets the same checks as the old ones.

The kinds: `Int` (bounded; the default bound is what a count, an index or a token id can be),
`Float` (finite, bounded), `Seconds` (a finite positive-or-zero time a timer can wait), `Port`,
`Choice`, `Text` (free text), `SlurmText` (a string that reaches sbatch or a shell: no control
characters, so a newline cannot end the `#SBATCH` block), `SlurmTime` (Slurm's six time-limit forms,
`slurm_time_seconds`), `Network` (an interface name or a CIDR), `Size` (`512MB`), `HostPort`, `Path`
(a path: `SlurmText`'s rule, since paths reach sbatch and scripts, and one the filesystem can
name), `Name` (one file or directory name the run makes), `Bool`, `ListOf`, `Mapping`, `Nested` (a
dataclass with its own `KINDS`).

Each kind bounds its values to what the code can hold: a count to an int32, a size to 1 PiB (parsed
exactly), a number to a finite float, a free mapping's integers to an int64, a string to UTF-8
text, a path to NAME_MAX and PATH_MAX. Layer indices, bounded by the resolved target or draft, are
declared beside the recipe (`schema.LAYER_FIELDS`) and checked with the couplings.

Every check raises `ConfigError` naming the key relative to its section; the recipe loader adds the
section prefix, so the user sees `store.kv_lease_ttl_s must be > 0, got -1`. `read_text` reads a
file the user named as UTF-8, one line on any failure.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
from collections.abc import Mapping as MappingABC
from dataclasses import dataclass
from decimal import Context, Decimal
from pathlib import Path as FsPath
from typing import Any

from hpctoolkit.errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# A count, index, token id or step: what an int32 tensor index or a C int takes.
COUNT_MAX = 2**31 - 1
# A seed: what numpy's and torch's generators take.
SEED_MAX = 2**32 - 1
# A byte size: what an int64 holds, with room for the sums the sizing makes (1 PiB).
SIZE_MAX = 1 << 50
# The longest wait a timer takes (threading.TIMEOUT_MAX is larger; a year is plenty).
SECONDS_MAX = 365 * 24 * 3600.0
PORT_MAX = 65535
# Linux IFNAMSIZ - 1.
IFNAME_MAX = 15
# A file name, in bytes (Linux NAME_MAX), and a whole path (PATH_MAX less its NUL).
NAME_MAX = 255
PATH_MAX = 4095
# What a mapping's integers may be: the libraries they reach (vLLM, a chat template) hold int64.
INT64_MAX = 2**63 - 1
SHOWN_MAX = 100  # characters of a value a message shows whole (`shown`)
_IFNAME = re.compile(r"^[A-Za-z0-9_.:@-]+$")
SLURM_TIME_FORMS = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"


def shown(value: Any) -> str:
    """`value`'s repr for a message; past `SHOWN_MAX` characters its middle is left out (a
    400-digit number or a long path still reads as one line)."""
    text = repr(value)
    return text if len(text) <= SHOWN_MAX else f"{text[:60]}...{text[-20:]} ({len(text)} characters)"


def require(cond: bool, key: str, why: str, value: Any) -> None:
    if not cond:
        raise ConfigError(f"{key} {why}, got {shown(value)}")


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
    """Bytes from `512MB`, `4GiB`, `1g` or a plain integer (at most `SIZE_MAX`)."""
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    else:
        m = _SIZE.match(str(text))
        if not m:
            raise ConfigError(f"{key} must be a size like 512MB or 4GB, got {shown(text)}")
        unit = m.group(2).upper().replace("I", "").rstrip("B") or ""
        whole = m.group(1).partition(".")[0].lstrip("0")
        # Exactly, in decimal: a float turns 400 digits into inf, and int() refuses 4300.
        n = SIZE_MAX + 1
        if len(whole) <= len(str(SIZE_MAX)):
            n = int(Context(prec=60).multiply(Decimal(m.group(1)), _UNITS[unit]))
    require(n > 0, key, "must be a positive size", text)
    require(n <= SIZE_MAX, key, f"must be at most {SIZE_MAX} bytes (1 PiB)", text)
    return n


def check_unicode(key: str, text: str) -> None:
    """`text` must encode as UTF-8: a lone surrogate (YAML's "\\ud800", or a byte of an argument
    that is not UTF-8) can become neither a file name nor a process argument."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        n = ord(text[err.start])
        escaped = 0xDC80 <= n <= 0xDCFF  # a byte that is not UTF-8, as Python reads argv
        found = f"byte 0x{n - 0xDC00:02x}, not UTF-8" if escaped else f"{chr(n)!r}, a lone surrogate"
        raise ConfigError(f"{key} must be UTF-8 text (found {found}), got {shown(text)}") from None


def control_char(text: str) -> str | None:
    """The first control character of `text` (newline, tab, NUL, DEL, ...), as its repr; else None."""
    for ch in text:
        if ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0 or ch in "\u2028\u2029":
            return repr(ch)
    return None


def slurm_time_seconds(text: str, key: str = "cluster.time") -> int:
    """Seconds of a Slurm time limit in one of its six forms: `MM`, `MM:SS`, `HH:MM:SS`, `D-HH`,
    `D-HH:MM`, `D-HH:MM:SS` (the leading field may exceed its usual range, as Slurm allows: `90` is
    90 minutes, `48:00:00` two days). `ConfigError` naming `key` for anything else, for a limit of 0
    (Slurm's "no limit"), and for UNLIMITED/INFINITE (the trainers' warning signal needs a limit)."""
    bad = ConfigError(f"{key} must be a Slurm time limit ({SLURM_TIME_FORMS}), got {text!r}")
    if not isinstance(text, str) or text != text.strip() or not text:
        raise bad
    days_text, dash, rest = text.partition("-")
    if not dash:
        days_text, rest = "", text
    parts = rest.split(":")
    fields = [days_text, *parts] if dash else parts
    if not all(p.isascii() and p.isdigit() and len(p) <= 9 for p in fields):
        raise bad
    nums = [int(p) for p in parts]
    if dash:
        if len(nums) > 3:
            raise bad
        h, m, s = [*nums, 0, 0][:3]
        days = int(days_text)
        require_ranges = h < 24 and m < 60 and s < 60
    elif len(nums) == 1:
        days, h, m, s = 0, 0, nums[0], 0
        require_ranges = True
    elif len(nums) == 2:
        days, h, m, s = 0, 0, nums[0], nums[1]
        require_ranges = s < 60
    elif len(nums) == 3:
        days, (h, m, s) = 0, nums
        require_ranges = m < 60 and s < 60
    else:
        raise bad
    if not require_ranges:
        raise bad
    total = ((days * 24 + h) * 60 + m) * 60 + s
    if total <= 0:
        raise ConfigError(f"{key} must be a time limit > 0 ({SLURM_TIME_FORMS}), got {text!r}")
    require(total <= COUNT_MAX * 60, key, "is longer than Slurm can hold", text)
    return total


def read_text(path: str | os.PathLike[str], what: str) -> str:
    """The text of the file the user named at `path` (`what`: the key or kind that named it), read
    as UTF-8. `ConfigError`, one line naming `what` and the file, when it is missing, not a file,
    unreadable, or not UTF-8."""
    p = FsPath(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{what}: {p} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{what}: {p} is a directory, not a file") from None
    except OSError as err:
        raise ConfigError(f"{what}: cannot read {p} ({err.strerror or err})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ConfigError(
            f"{what}: {p} is not UTF-8 text (byte 0x{data[err.start]:02x} at line {line}, offset {err.start})"
        ) from None


class Kind:
    """What one field accepts. `optional`: None is accepted too."""

    optional: bool = False

    def check(self, key: str, value: Any) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Bool(Kind):
    optional: bool = False

    def check(self, key: str, value: Any) -> None:
        require(isinstance(value, bool), key, "must be true or false", value)


@dataclass(frozen=True)
class Int(Kind):
    """An integer in `lo..hi` (`hi` defaults to `COUNT_MAX`)."""

    lo: int | None = None
    hi: int = COUNT_MAX
    optional: bool = False

    def check(self, key: str, value: Any) -> None:
        require(isinstance(value, int) and not isinstance(value, bool), key, "must be an integer", value)
        if self.lo is not None:
            why = "must be > 0" if self.lo == 1 else f"must be >= {self.lo}"
            require(value >= self.lo, key, why, value)
        require(value <= self.hi, key, f"must be <= {self.hi}", value)


@dataclass(frozen=True)
class Float(Kind):
    """A finite number in `lo..hi` (each end open where `lo_open` / `hi_open`), and at most `cap`
    (a bound of what the code can use rather than of the meaning, reported on its own)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    optional: bool = False
    cap: float | None = None

    def check(self, key: str, value: Any) -> None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        require(ok, key, "must be a number", value)
        # An int is finite (and math.isfinite cannot take one past a float's range).
        require(isinstance(value, int) or math.isfinite(value), key, "must be a finite number", value)
        lo_ok = self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)
        hi_ok = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        if self.lo is not None and self.hi is not None:
            span = f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
            require(lo_ok and hi_ok, key, f"must lie in {span}", value)
        if not lo_ok:
            require(False, key, f"must be {'>' if self.lo_open else '>='} {self.lo:g}", value)
        if not hi_ok:
            require(False, key, f"must be {'<' if self.hi_open else '<='} {self.hi:g}", value)
        if self.cap is not None:
            require(value <= self.cap, key, f"must be <= {self.cap:g}", value)


def Seconds(*, zero: bool = False, optional: bool = False) -> Float:  # noqa: N802 -- a kind's name
    """A time in seconds: finite, > 0 (>= 0 with `zero`), at most a year."""
    return Float(lo=0.0, lo_open=not zero, cap=SECONDS_MAX, optional=optional)


@dataclass(frozen=True)
class Port(Kind):
    """A TCP port 1..65535; with `zero`, 0 ("pick a free one") too."""

    zero: bool = False
    optional: bool = False

    def check(self, key: str, value: Any) -> None:
        Int(0 if self.zero else 1, PORT_MAX).check(key, value)


@dataclass(frozen=True)
class Choice(Kind):
    choices: tuple[str, ...] = ()
    optional: bool = False

    def check(self, key: str, value: Any) -> None:
        require(value in self.choices, key, f"must be one of {list(self.choices)}", value)


@dataclass(frozen=True)
class Text(Kind):
    """Free text (a prompt, a token string): any characters; `nonempty` refuses ""."""

    nonempty: bool = False
    optional: bool = False

    def check(self, key: str, value: Any) -> None:
        require(isinstance(value, str), key, "must be a string", value)
        check_unicode(key, value)
        if self.nonempty:
            require(bool(value), key, "must not be empty", value)


@dataclass(frozen=True)
class SlurmText(Kind):
    """A string that reaches sbatch, a batch script or a command line: no control characters (a
    newline in `#SBATCH --job-name` would end the directives, silently dropping the ones after
    it). `word`: no whitespace either; `nonempty` refuses ""."""

    word: bool = False
    nonempty: bool = False
    optional: bool = False

    def check(self, key: str, value: Any) -> None:
        require(isinstance(value, str), key, "must be a string", value)
        check_unicode(key, value)
        bad = control_char(value)
        require(bad is None, key, f"must hold no control characters (found {bad})", value)
        if self.nonempty:
            require(bool(value.strip()), key, "must not be empty", value)
        if self.word:
            require(not any(c.isspace() for c in value), key, "must be one word (no spaces)", value)


@dataclass(frozen=True)
class Path(Kind):
    """A path (or a `builtin:` / `pypi:` name): `SlurmText`'s rule, and one the filesystem can
    name: each component at most `NAME_MAX` bytes, the whole at most `PATH_MAX` less `room` (what
    the run writes below it). `slurm_pattern`: it also names files in `#SBATCH --output`, a
    Slurm file-name pattern where `%` expands and a backslash stops the expansion, so neither
    may appear. `nonempty` refuses ""."""

    nonempty: bool = False
    optional: bool = False
    room: int = 0
    slurm_pattern: bool = False

    def check(self, key: str, value: Any) -> None:
        SlurmText(nonempty=self.nonempty).check(key, value)
        part = max(value.split("/"), key=lambda p: len(p.encode()))
        n = len(part.encode())
        why = f"must name each directory and file in at most {NAME_MAX} bytes ({part[:16]!r}... has {n})"
        require(n <= NAME_MAX, key, why, value)
        most = PATH_MAX - self.room
        room = f" ({PATH_MAX} less {self.room} for the run's files below it)" if self.room else ""
        require(len(value.encode()) <= most, key, f"must be at most {most} bytes long{room}", value)
        if self.slurm_pattern:
            why = (
                "must hold no % or \\ (it names the job's log in #SBATCH --output, where Slurm expands them)"
            )
            require("%" not in value and "\\" not in value, key, why, value)


@dataclass(frozen=True)
class Name(Kind):
    """A name that becomes one file or directory name, `reserve` bytes longer once the code
    appends to it (a run's name: its run directory is `<name>-<UTC time>-<4 hex>`): `SlurmText`'s
    word, no `/`, not `.` or `..`, at most `NAME_MAX - reserve` bytes."""

    reserve: int = 0
    optional: bool = False

    def check(self, key: str, value: Any) -> None:
        SlurmText(word=True, nonempty=True).check(key, value)
        require("/" not in value and value not in (".", ".."), key, "must be one file name (no /)", value)
        most = NAME_MAX - self.reserve
        grows = f" (a file name holds {NAME_MAX}; the code appends {self.reserve})" if self.reserve else ""
        require(len(value.encode()) <= most, key, f"must be at most {most} bytes{grows}", value)


@dataclass(frozen=True)
class SlurmTime(Kind):
    optional: bool = False

    def check(self, key: str, value: Any) -> None:
        slurm_time_seconds(value, key)


@dataclass(frozen=True)
class Network(Kind):
    """An interface name (`ib0`) or a CIDR (`10.1.0.0/16`)."""

    optional: bool = False

    def check(self, key: str, value: Any) -> None:
        SlurmText(nonempty=True, word=True).check(key, value)
        if "/" in value:
            try:
                ipaddress.ip_network(value, strict=False)
            except ValueError as err:
                raise ConfigError(f"{key} is not a valid CIDR ({err}), got {value!r}") from None
            return
        require(
            len(value) <= IFNAME_MAX and _IFNAME.match(value) is not None,
            key,
            f"must be an interface name (at most {IFNAME_MAX} of A-Z a-z 0-9 _ . : @ -) or a CIDR like 10.1.0.0/16",
            value,
        )


@dataclass(frozen=True)
class Size(Kind):
    """A byte size: a recipe writes `512MB`, `4GiB` or a number of bytes (`empty`: "" means
    unset), parsed once at load (`recipe.load`) into the bytes the section holds (None: unset)."""

    empty: bool = False
    optional: bool = False

    def check(self, key: str, value: Any) -> None:
        if self.empty and value == "":
            return
        parse_size(value, key)


@dataclass(frozen=True)
class HostPort(Kind):
    optional: bool = False

    def check(self, key: str, value: Any) -> None:
        SlurmText(word=True).check(key, value)
        host, _, port = value.rpartition(":")
        ok = bool(host) and port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) <= PORT_MAX
        require(ok, key, "must be host:port (port 1..65535)", value)


@dataclass(frozen=True)
class ListOf(Kind):
    item: Kind = dataclasses.field(default_factory=Kind)
    max_len: int = COUNT_MAX
    optional: bool = False

    def check(self, key: str, value: Any) -> None:
        require(isinstance(value, list), key, "must be a list", value)
        require(len(value) <= self.max_len, key, f"must hold at most {self.max_len} entries", len(value))
        for i, v in enumerate(value):
            check_value(self.item, f"{key}[{i}]", v)


@dataclass(frozen=True)
class Mapping(Kind):
    """A free mapping (passed on to a library that checks it, e.g. `engine.extra_args`); `why` says who."""

    why: str = ""
    optional: bool = False

    def check(self, key: str, value: Any) -> None:
        require(isinstance(value, MappingABC), key, "must be a mapping", value)
        for k in value:
            require(isinstance(k, str), key, "must have string keys", k)
        _free_values(key, value)


def _free_values(key: str, value: Any) -> None:
    """The values of a free mapping, nested ones too, as far as any library can take them: text
    that encodes as UTF-8, integers an int64 holds."""
    if isinstance(value, MappingABC):
        for k, v in value.items():
            _free_values(f"{key}.{k}", v)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _free_values(f"{key}[{i}]", v)
    elif isinstance(value, str):
        check_unicode(key, value)
    elif isinstance(value, int) and not isinstance(value, bool):
        ok = -INT64_MAX - 1 <= value <= INT64_MAX
        require(ok, key, f"must be an integer an int64 holds (at most {INT64_MAX})", value)


@dataclass(frozen=True)
class Nested(Kind):
    """A dataclass with its own `KINDS`, checked field by field."""

    optional: bool = False

    def check(self, key: str, value: Any) -> None:
        require(dataclasses.is_dataclass(value), key, "must be a section", value)
        check_fields(value, f"{key}.")


def check_value(kind: Kind, key: str, value: Any) -> None:
    if value is None:
        require(kind.optional, key, "must be set", value)
        return
    kind.check(key, value)


def kinds_of(cls: type) -> dict[str, Kind]:
    """`cls.KINDS`, checked to name every field and nothing else (a bug, not a user mistake)."""
    kinds: dict[str, Kind] = getattr(cls, "KINDS", {})
    names = [f.name for f in dataclasses.fields(cls)]
    missing = [n for n in names if n not in kinds]
    extra = [n for n in kinds if n not in names]
    if missing or extra:
        raise TypeError(f"{cls.__name__}.KINDS must name each field once: missing {missing}, extra {extra}")
    return kinds


def check_fields(obj: Any, prefix: str = "") -> None:
    """Check every field of the dataclass `obj` against its declared kind; `ConfigError` naming
    `prefix + field` for the first that does not fit."""
    kinds = kinds_of(type(obj))
    for f in dataclasses.fields(obj):
        check_value(kinds[f.name], f"{prefix}{f.name}", getattr(obj, f.name))
