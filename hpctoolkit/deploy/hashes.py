"""Wheels pinned by content: each pin of the wheelhouse lock carries its wheel's sha256.

A pin line is `name==version --hash=sha256:HEX` (pip's requirement-file syntax, so pip itself can
check a download or an install against the lock). The hash is what was reviewed: a wheel whose
bytes differ, whatever its name says, is tampered with or substituted, and is refused.

Standard library only: launch/install_wheelhouse.sh runs this file with a GPU node's bare
interpreter, which may lack `packaging`, before it installs anything:

    python -I hpctoolkit/deploy/hashes.py LOCK WHEEL...

prints one line for pip's `--require-hashes` per wheel the lock pins (`file:///...whl
--hash=sha256:HEX`, the hash taken from the lock, so that pip checks the bytes a second time) and
exits 0; or prints one line per problem to stderr and exits 1: a wheel whose sha256 is not its
pin's, a wheel the lock does not pin, a pin with no wheel, a pin without a hash, a malformed line.
hpctoolkit's own wheel, built from the checkout it ships with, is not pinned and gets no line.
`hpctoolkit.deploy.lock` parses the same field, strictly, along with the rest of the lock.
"""

from __future__ import annotations

import hashlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

HASH_OPTION = "--hash=sha256:"
HASH_RE = re.compile(r"^--hash=sha256:(?P<hex>[0-9a-f]{64})$")
OWN = "hpctoolkit"
# What a refused pin is told to do: the only way a hash enters or changes in the lock.
REFRESH = "`make wheelhouse-lock-refresh` records it, for review"


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares it (`Foo_Bar.baz` -> `foo-bar-baz`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(filename: str) -> str:
    """The canonical distribution name of a wheel file name (its first `-` field)."""
    return canonical(filename.split("-", 1)[0])


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def short(hex_digest: str) -> str:
    """Enough of a digest to tell two apart in a one-line message."""
    return hex_digest[:16] + "..."


@dataclass(frozen=True)
class Entry:
    """One pin line of a lock, as the installer needs it: `pin` is its `name==version` text."""

    name: str
    pin: str
    line: int
    sha256: str | None


def read_entries(text: str, path: str) -> tuple[dict[str, Entry], list[str]]:
    """The lock's pins by canonical name, and its malformed lines (one problem each)."""
    entries: dict[str, Entry] = {}
    problems: list[str] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        fields = raw.split()
        if not fields or fields[0].startswith("#"):
            continue
        name, sep, _ = fields[0].partition("==")
        hashes = [HASH_RE.match(f) for f in fields[1:]]
        if not sep or not name or len(fields) > 2 or not all(hashes):
            problems.append(f"{path}:{number}: {raw.strip()!r} is not `name==version --hash=sha256:HEX`")
            continue
        if canonical(name) in entries:
            first = entries[canonical(name)].line
            problems.append(f"{path}:{number}: {canonical(name)} is named twice (first on line {first})")
            continue
        m = hashes[0] if hashes else None
        entries[canonical(name)] = Entry(canonical(name), fields[0], number, m.group("hex") if m else None)
    return entries, problems


def unhashed(path: str, entry: Entry) -> str:
    return f"{path}:{entry.line}: {entry.pin} has no {HASH_OPTION}HEX; a pin without its hash is refused ({REFRESH})"


def mismatch(filename: str, actual: str, path: str, line: int, pin: str, expected: str) -> str:
    return (
        f"{filename}: sha256 {short(actual)}, but {path}:{line} pins {pin} {HASH_OPTION}{short(expected)}: "
        "a tampered or substituted wheel is refused"
    )


def verify(lock_text: str, lock_path: str, wheels: list[Path]) -> tuple[list[str], list[str]]:
    """(problems, pip requirement lines): every wheel against the lock, and every pin against the wheels."""
    entries, problems = read_entries(lock_text, lock_path)
    problems += [unhashed(lock_path, e) for e in entries.values() if e.sha256 is None]
    lines: list[str] = []
    seen: set[str] = set()
    for wheel in sorted(wheels, key=lambda p: p.name):
        name = wheel_name(wheel.name)
        entry = entries.get(name)
        if entry is None:
            if name != OWN:
                problems.append(f"{wheel.name}: {lock_path} pins no {name}; refused")
            continue
        seen.add(name)
        if entry.sha256 is None:
            continue  # refused above, by its line
        actual = sha256_file(wheel)
        if actual != entry.sha256:
            problems.append(mismatch(wheel.name, actual, lock_path, entry.line, entry.pin, entry.sha256))
            continue
        lines.append(f"{wheel.resolve().as_uri()} {HASH_OPTION}{entry.sha256}")
    for name, entry in entries.items():
        if name not in seen:
            problems.append(f"missing: {entry.pin} ({lock_path}:{entry.line}): no wheel of it was given")
    return problems, lines


def main(argv: list[str]) -> int:
    if len(argv) < 1:
        print("usage: hashes.py LOCK WHEEL...", file=sys.stderr)
        return 2
    lock = argv[0]
    try:
        text = Path(lock).read_text(encoding="utf-8")
    except OSError as err:
        print(f"{lock}: cannot read the lock ({err.strerror})", file=sys.stderr)
        return 1
    problems, lines = verify(text, lock, [Path(a) for a in argv[1:]])
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
