"""Check an offline CUDA wheelhouse against its lock, with no network.

    python -m hpctoolkit.deploy.wheelhouse check [--lock L] [--wheelhouse D] [--pyproject P] [--require-own]
    python -m hpctoolkit.deploy.wheelhouse missing [--refresh] | stale [--lock L] [--wheelhouse D]
    python -m hpctoolkit.deploy.wheelhouse refresh [--lock L] [--wheelhouse D]
    python -m hpctoolkit.deploy.wheelhouse platforms

`check` prints one summary line and exits 0, or one line per problem and exits 2. It holds the
folder to the lock (`hpctoolkit.deploy.lock`): each pin has exactly one wheel of its version for
CPython 3.12 on manylinux x86-64, whose sha256 is the pin's `--hash` (a tampered or substituted
wheel is refused, named); nothing else is there but hpctoolkit's own wheel; every
Requires-Dist of every carried wheel, its markers evaluated for CPython 3.12 on Linux x86-64 and
its extras followed only where a carried wheel requests them, is met by a pin whose version the
specifier contains, or is named under `# image:` or `# skip:`. It also holds the lock to
pyproject.toml and to its patch series folder. `missing` prints the pins without their wheel
(`name==version --hash=sha256:HEX`, what `make wheelhouse` downloads with pip's `--require-hashes`;
bare `name==version` with `--refresh`), `stale` the files the lock does not name (what it removes),
`platforms` pip's `--platform` flags for the target. `refresh`, and only it, writes the lock: each
pin's `--hash` becomes the sha256 of its wheel in the folder, and the diff is printed for review
(`make wheelhouse-lock-refresh`); it refuses while a pin lacks its wheel or a wheel is not a pin's.

`check_wheelhouse` is pure: it takes the file names and their METADATA text (`read_wheelhouse`
reads them from the zip files' central directories, never extracting).
"""

from __future__ import annotations

import difflib
import email.parser
import sys
import tomllib
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import InvalidRequirement, Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import (
    InvalidWheelFilename,
    NormalizedName,
    canonicalize_name,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

from hpctoolkit.cli import parse, parser, run_cli
from hpctoolkit.deploy.hashes import REFRESH, mismatch, sha256_file
from hpctoolkit.deploy.lock import Lock, Pin, check_project, parse_lock, series_version
from hpctoolkit.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
OWN = canonicalize_name("hpctoolkit")
PYTHON = (3, 12)
# manylinux_2_5 .. 2_34 and the legacy aliases: what the GPU nodes' glibc (2.35 and later) runs.
GLIBC_MINORS = range(34, 4, -1)
PLATFORMS = (
    *(f"manylinux_2_{minor}_x86_64" for minor in GLIBC_MINORS),
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
)
TARGET = "CPython 3.12 on manylinux x86-64"
MARKER_ENV = {
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "platform_release": "",
    "platform_system": "Linux",
    "platform_version": "",
    "python_full_version": "3.12.3",
    "python_version": "3.12",
    "sys_platform": "linux",
}


def supported_tags() -> frozenset[Tag]:
    return frozenset(
        [*cpython_tags(PYTHON, platforms=PLATFORMS), *compatible_tags(PYTHON, platforms=PLATFORMS)]
    )


@dataclass(frozen=True)
class WheelFile:
    """One entry of a wheelhouse folder: its name, size, METADATA text when it is a readable wheel,
    and its sha256 (None where it was not read: `missing` and `stale` go by name and version only)."""

    filename: str
    size: int = 0
    metadata: str | None = None
    error: str = ""
    sha256: str | None = None


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    carried: dict[NormalizedName, WheelFile] = field(default_factory=dict)
    own: list[WheelFile] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    missing: list[Pin] = field(default_factory=list)
    # Carried wheels whose bytes are not their pin's (still carried: the name and version are right).
    tampered: list[str] = field(default_factory=list)
    met: dict[str, int] = field(default_factory=lambda: {"pin": 0, "image": 0, "skip": 0})

    def add(self, problem: str) -> None:
        if problem not in self.problems:
            self.problems.append(problem)


def check_wheelhouse(
    lock: Lock,
    wheels: Sequence[WheelFile],
    *,
    require_own: bool = False,
    check_hashes: bool = True,
    check_requirements: bool = True,
) -> Report:
    """Hold the folder's entries to the lock; the report's problems are one line each.

    With `check_hashes`, each carried wheel whose sha256 was read must be its pin's `--hash`. A
    refresh turns both checks off: it wants the files only, one wheel per pin and nothing else.
    """
    report = Report()
    found: dict[NormalizedName, list[WheelFile]] = {name: [] for name in lock.pins}
    tags = supported_tags()
    for wheel in sorted(wheels, key=lambda w: w.filename):
        problem = _classify(lock, wheel, tags, found, report)
        if problem:
            report.add(f"{wheel.filename}: {problem}")
            report.stale.append(wheel.filename)
    for name, pin in lock.pins.items():
        files = found[name]
        if not files:
            report.missing.append(pin)
            report.add(f"missing: {pin} ({lock.path}:{pin.line}); `make wheelhouse` downloads it")
        elif len(files) > 1:
            report.add(f"{pin}: {len(files)} wheels ({', '.join(w.filename for w in files)}); keep one")
        else:
            report.carried[name] = files[0]
            if check_hashes:
                _check_hash(lock, pin, files[0], report)
    if len(report.own) > 1:
        report.add(
            f"hpctoolkit: {len(report.own)} wheels ({', '.join(w.filename for w in report.own)}); keep one"
        )
    elif require_own and not report.own:
        report.add("missing: hpctoolkit's own wheel; `make wheelhouse` builds it")
    if check_requirements:
        _check_requirements(lock, report)
    return report


def _classify(
    lock: Lock,
    wheel: WheelFile,
    tags: frozenset[Tag],
    found: dict[NormalizedName, list[WheelFile]],
    report: Report,
) -> str:
    """Why this entry does not belong (an empty string when it does; it is then filed)."""
    if not wheel.filename.endswith(".whl"):
        return "not a wheel: the folder holds the lock's wheels and hpctoolkit's own only"
    try:
        name, version, _, file_tags = parse_wheel_filename(wheel.filename)
    except InvalidWheelFilename as err:
        return f"not a wheel file name ({err})"
    if wheel.metadata is None:
        return wheel.error or "unreadable wheel"
    meta = email.parser.Parser().parsestr(wheel.metadata, headersonly=True)
    if canonicalize_name(meta.get("Name", "")) != name or _version(meta.get("Version", "")) != version:
        return f"its METADATA names {meta.get('Name')} {meta.get('Version')}, not {name} {version}"
    if name == OWN:
        report.own.append(wheel)
        return ""
    pin = lock.pins.get(name)
    if pin is None:
        return f"{name} is not pinned by {lock.path}"
    if version != pin.version:
        return f"version {version}, but {lock.path}:{pin.line} pins {pin}"
    if not file_tags & tags:
        return f"not for {TARGET} ({', '.join(sorted(str(t) for t in file_tags))})"
    found[name].append(wheel)
    return ""


def _check_hash(lock: Lock, pin: Pin, wheel: WheelFile, report: Report) -> None:
    if pin.sha256 is None:
        report.add(f"{lock.path}:{pin.line}: {pin} has no --hash=sha256:HEX; refused ({REFRESH})")
    elif wheel.sha256 is not None and wheel.sha256 != pin.sha256:
        report.tampered.append(wheel.filename)
        report.add(
            mismatch(wheel.filename, wheel.sha256, lock.path, pin.line, str(pin), pin.sha256)
            + f"; remove it so that `make wheelhouse` fetches {pin} again, or take its bytes with"
            " `make wheelhouse-lock-refresh` after review"
        )


def _version(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:
        return None


def requirements(metadata: str) -> list[Requirement]:
    """The Requires-Dist entries of a METADATA text (an unparsable one raises `InvalidRequirement`)."""
    meta = email.parser.Parser().parsestr(metadata, headersonly=True)
    return [Requirement(text) for text in meta.get_all("Requires-Dist") or []]


def applies(req: Requirement, extras: frozenset[str]) -> bool:
    """Whether `req` is required on the target, with `extras` of its wheel requested."""
    if req.marker is None:
        return True
    return any(_evaluate(req.marker, extra) for extra in ("", *sorted(extras)))


def _evaluate(marker: Marker, extra: str) -> bool:
    return marker.evaluate({**MARKER_ENV, "extra": extra})


def _short(req: Requirement) -> str:
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    return f"{req.name}{extras}{req.specifier}"


def _check_requirements(lock: Lock, report: Report) -> None:
    """Follow every carried wheel's requirements, and the extras carried wheels request of each other."""
    todo: list[tuple[NormalizedName, frozenset[str]]] = [
        (n, frozenset()) for n in report.carried if n not in lock.data
    ]
    todo += [(OWN, frozenset())] if len(report.own) == 1 else []
    done: set[tuple[NormalizedName, frozenset[str]]] = set()
    while todo:
        item = todo.pop(0)
        if item in done:
            continue
        done.add(item)
        name, extras = item
        wheel = report.own[0] if name == OWN else report.carried[name]
        assert wheel.metadata is not None  # classified as readable
        try:
            reqs = requirements(wheel.metadata)
        except InvalidRequirement as err:
            report.add(f"{wheel.filename}: unparsable Requires-Dist ({err})")
            continue
        for req in reqs:
            if not applies(req, extras):
                continue
            target = canonicalize_name(req.name)
            problem = _meet(lock, report, req, target)
            if problem:
                report.add(f"{wheel.filename}: requires {_short(req)}, {problem}")
            elif req.extras and target in report.carried and target not in lock.data:
                todo.append((target, frozenset(canonicalize_name(e) for e in req.extras)))


def _meet(lock: Lock, report: Report, req: Requirement, target: NormalizedName) -> str:
    """Why `req` is not met (empty when it is); counts how it was met."""
    pin = lock.pins.get(target)
    if pin is not None:
        if target not in lock.override and not req.specifier.contains(pin.version, prereleases=True):
            return f"but {lock.path}:{pin.line} pins {pin}"
        report.met["pin"] += 1
        return ""
    how = lock.declared(target)
    if how is None:
        return f"which {lock.path} neither pins nor names under `# image:` or `# skip:`"
    report.met[how] += 1
    return ""


def read_wheelhouse(folder: Path, *, hashes: bool = True) -> list[WheelFile]:
    """Every entry of `folder`, with each wheel's METADATA read from its zip directory (and its sha256)."""
    out = []
    for path in sorted(folder.iterdir()):
        if path.is_dir() or not path.name.endswith(".whl"):
            out.append(WheelFile(path.name + ("/" if path.is_dir() else "")))
            continue
        size = path.stat().st_size
        try:
            with zipfile.ZipFile(path) as zf:
                names = [n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
                if len(names) != 1:
                    out.append(
                        WheelFile(path.name, size, None, f"{len(names)} .dist-info/METADATA files, not 1")
                    )
                    continue
                text = zf.read(names[0]).decode("utf-8")
        except (zipfile.BadZipFile, UnicodeDecodeError) as err:
            out.append(WheelFile(path.name, size, None, f"unreadable wheel ({err})"))
            continue
        out.append(WheelFile(path.name, size, text, sha256=sha256_file(path) if hashes else None))
    return out


def default_lock() -> Path:
    """The lock of the newest patch series of this checkout."""
    locks = sorted(ROOT.glob("patches/vllm/v*/wheelhouse.lock"), key=lambda p: _version_key(p.parent.name))
    if not locks:
        raise ConfigError(f"no patches/vllm/v*/wheelhouse.lock under {ROOT}: pass --lock")
    return locks[-1]


def _version_key(folder: str) -> tuple[int, ...]:
    return tuple(int(p) for p in folder.lstrip("v").split(".") if p.isdigit())


def load_lock(path: Path, *, require_hashes: bool = True) -> Lock:
    if not path.is_file():
        raise ConfigError(f"no lock at {path}")
    return parse_lock(path.read_text(encoding="utf-8"), str(path), require_hashes=require_hashes)


def refreshed(text: str, lock: Lock, report: Report) -> str:
    """The lock's text with each carried pin's `--hash` set to its wheel's sha256; the rest as it was.

    Pure. The pin's own spelling of its name and version is kept; comments and blank lines too.
    """
    lines = text.splitlines(keepends=True)
    for name, pin in lock.pins.items():
        wheel = report.carried.get(name)
        if wheel is None or wheel.sha256 is None:
            raise ConfigError(
                f"{lock.path}:{pin.line}: no wheel of {pin} whose sha256 was read; nothing to record"
            )
        raw = lines[pin.line - 1]
        end = raw[len(raw.rstrip("\r\n")) :]
        lines[pin.line - 1] = f"{raw.split()[0]} --hash=sha256:{wheel.sha256}{end}"
    return "".join(lines)


def refresh(lock_path: Path, folder: Path) -> int:
    """Record the folder's sha256 in the lock, print the diff; refuse while the folder is incomplete."""
    lock = load_lock(lock_path, require_hashes=False)
    report = check_wheelhouse(lock, read_wheelhouse(folder), check_hashes=False, check_requirements=False)
    if report.problems:
        for problem in report.problems:
            print(problem, file=sys.stderr)
        print(
            f"{lock.path}: not refreshed: the folder {folder} does not hold the lock's wheels",
            file=sys.stderr,
        )
        return 2
    old = lock_path.read_text(encoding="utf-8")
    new = refreshed(old, lock, report)
    if new == old:
        print(f"[wheelhouse] {lock.path}: every pin's sha256 is already its wheel's; nothing to refresh")
        return 0
    diff = difflib.unified_diff(old.splitlines(True), new.splitlines(True), str(lock_path), str(lock_path))
    sys.stdout.writelines(diff)
    tmp = lock_path.with_name(lock_path.name + ".tmp")
    tmp.write_text(new, encoding="utf-8")
    tmp.replace(lock_path)
    changed = sum(1 for a, b in zip(old.splitlines(), new.splitlines(), strict=True) if a != b)
    print(
        f"[wheelhouse] {lock.path}: {changed} pin lines refreshed (the diff above); review it before committing"
    )
    return 0


def project_problems(lock: Lock, pyproject: Path | None) -> list[str]:
    """The lock against pyproject.toml (by default the one of the checkout the lock sits in)."""
    if pyproject is None and series_version(lock.path):
        pyproject = Path(lock.path).resolve().parents[3] / "pyproject.toml"
    if pyproject is None or not pyproject.is_file():
        at = f" at {pyproject}" if pyproject else ""
        return [
            *check_project(lock, {}, ""),
            f"{lock.path}: no pyproject.toml{at} to hold its pins to: pass --pyproject",
        ]
    with pyproject.open("rb") as f:
        return check_project(lock, tomllib.load(f), str(pyproject))


def _summary(lock: Lock, report: Report, folder: Path) -> str:
    files = [*report.carried.values(), *report.own]
    size = sum(w.size for w in files) / 1e9
    own = " + hpctoolkit's own wheel" if report.own else ""
    met = report.met
    return (
        f"wheelhouse ok: {len(report.carried)} pins of {lock.path}{own} in {folder}, {size:.2f} GB, "
        f"each wheel's sha256 its pin's; "
        f"{sum(met.values())} requirements met ({met['pin']} by a pin, {met['image']} by the image, "
        f"{met['skip']} skipped)"
    )


def main(argv: list[str]) -> int:
    ap = parser("hpctoolkit.deploy.wheelhouse", __doc__)
    ap.add_argument("command", choices=("check", "missing", "stale", "refresh", "platforms"))
    ap.add_argument(
        "--lock", type=Path, default=None, help="default: the newest patches/vllm/v*/wheelhouse.lock"
    )
    ap.add_argument("--wheelhouse", type=Path, default=ROOT / "dist" / "wheelhouse")
    ap.add_argument("--pyproject", type=Path, default=None, help="default: the one of the lock's checkout")
    ap.add_argument("--require-own", action="store_true", help="hpctoolkit's own wheel must be there")
    ap.add_argument(
        "--refresh", action="store_true", help="missing: pins without their hash, for a refresh's download"
    )
    args = parse(ap, argv)
    if args.command == "platforms":
        print(" ".join(f"--platform {p}" for p in PLATFORMS))
        return 0
    lock_path: Path = args.lock or default_lock()
    folder: Path = args.wheelhouse
    if args.command == "refresh":
        if not folder.is_dir():
            raise ConfigError(f"no wheelhouse folder {folder}: nothing to refresh the hashes from")
        return refresh(lock_path, folder)
    # `stale` goes by name and version; a refresh's `missing` lists the pins it will hash.
    strict = args.command == "check" or (args.command == "missing" and not args.refresh)
    lock = load_lock(lock_path, require_hashes=strict)
    if not folder.is_dir():
        if args.command == "check":
            raise ConfigError(f"no wheelhouse folder {folder}: run `make wheelhouse` first")
        wheels: list[WheelFile] = []
    else:
        wheels = read_wheelhouse(folder, hashes=args.command == "check")
    report = check_wheelhouse(lock, wheels, require_own=args.require_own)
    if args.command == "missing":
        lines = [str(p) if args.refresh else f"{p} --hash=sha256:{p.sha256}" for p in report.missing]
        print("\n".join(lines), end="\n" if lines else "")
        return 0
    if args.command == "stale":
        print("\n".join(report.stale), end="\n" if report.stale else "")
        return 0
    problems = [*project_problems(lock, args.pyproject), *report.problems]
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        return 2
    print(_summary(lock, report, folder))
    return 0


if __name__ == "__main__":
    run_cli(main)
