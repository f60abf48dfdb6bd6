"""Check an offline CUDA wheelhouse against its lock, with no network.

    python -m hpctoolkit.deploy.wheelhouse check [--lock L] [--wheelhouse D] [--pyproject P] [--require-own]
    python -m hpctoolkit.deploy.wheelhouse missing|stale [--lock L] [--wheelhouse D]
    python -m hpctoolkit.deploy.wheelhouse platforms

`check` prints one summary line and exits 0, or one line per problem and exits 2. It holds the
folder to the lock (`hpctoolkit.deploy.lock`): each pin has exactly one wheel of its version for
CPython 3.12 on manylinux x86-64; nothing else is there but hpctoolkit's own wheel; every
Requires-Dist of every carried wheel, its markers evaluated for CPython 3.12 on Linux x86-64 and
its extras followed only where a carried wheel requests them, is met by a pin whose version the
specifier contains, or is named under `# image:` or `# skip:`. It also holds the lock to
pyproject.toml and to its patch series folder. `missing` prints the pins without their wheel
(`name==version`, what `make wheelhouse` downloads), `stale` the files the lock does not name
(what it removes), `platforms` pip's `--platform` flags for the target.

`check_wheelhouse` is pure: it takes the file names and their METADATA text (`read_wheelhouse`
reads them from the zip files' central directories, never extracting).
"""

from __future__ import annotations

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
    """One entry of a wheelhouse folder: its name, size, and METADATA text when it is a readable wheel."""

    filename: str
    size: int = 0
    metadata: str | None = None
    error: str = ""


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    carried: dict[NormalizedName, WheelFile] = field(default_factory=dict)
    own: list[WheelFile] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    missing: list[Pin] = field(default_factory=list)
    met: dict[str, int] = field(default_factory=lambda: {"pin": 0, "image": 0, "skip": 0})

    def add(self, problem: str) -> None:
        if problem not in self.problems:
            self.problems.append(problem)


def check_wheelhouse(lock: Lock, wheels: Sequence[WheelFile], *, require_own: bool = False) -> Report:
    """Hold the folder's entries to the lock; the report's problems are one line each."""
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
    if len(report.own) > 1:
        report.add(
            f"hpctoolkit: {len(report.own)} wheels ({', '.join(w.filename for w in report.own)}); keep one"
        )
    elif require_own and not report.own:
        report.add("missing: hpctoolkit's own wheel; `make wheelhouse` builds it")
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


def read_wheelhouse(folder: Path) -> list[WheelFile]:
    """Every entry of `folder`, with each wheel's METADATA read from its zip directory."""
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
        out.append(WheelFile(path.name, size, text))
    return out


def default_lock() -> Path:
    """The lock of the newest patch series of this checkout."""
    locks = sorted(ROOT.glob("patches/vllm/v*/wheelhouse.lock"), key=lambda p: _version_key(p.parent.name))
    if not locks:
        raise ConfigError(f"no patches/vllm/v*/wheelhouse.lock under {ROOT}: pass --lock")
    return locks[-1]


def _version_key(folder: str) -> tuple[int, ...]:
    return tuple(int(p) for p in folder.lstrip("v").split(".") if p.isdigit())


def load_lock(path: Path) -> Lock:
    if not path.is_file():
        raise ConfigError(f"no lock at {path}")
    return parse_lock(path.read_text(encoding="utf-8"), str(path))


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
        f"wheelhouse ok: {len(report.carried)} pins of {lock.path}{own} in {folder}, {size:.2f} GB; "
        f"{sum(met.values())} requirements met ({met['pin']} by a pin, {met['image']} by the image, "
        f"{met['skip']} skipped)"
    )


def main(argv: list[str]) -> int:
    ap = parser("hpctoolkit.deploy.wheelhouse", __doc__)
    ap.add_argument("command", choices=("check", "missing", "stale", "platforms"))
    ap.add_argument(
        "--lock", type=Path, default=None, help="default: the newest patches/vllm/v*/wheelhouse.lock"
    )
    ap.add_argument("--wheelhouse", type=Path, default=ROOT / "dist" / "wheelhouse")
    ap.add_argument("--pyproject", type=Path, default=None, help="default: the one of the lock's checkout")
    ap.add_argument("--require-own", action="store_true", help="hpctoolkit's own wheel must be there")
    args = parse(ap, argv)
    if args.command == "platforms":
        print(" ".join(f"--platform {p}" for p in PLATFORMS))
        return 0
    lock = load_lock(args.lock or default_lock())
    folder: Path = args.wheelhouse
    if not folder.is_dir():
        if args.command == "check":
            raise ConfigError(f"no wheelhouse folder {folder}: run `make wheelhouse` first")
        wheels: list[WheelFile] = []
    else:
        wheels = read_wheelhouse(folder)
    report = check_wheelhouse(lock, wheels, require_own=args.require_own)
    if args.command == "missing":
        print("\n".join(str(p) for p in report.missing), end="\n" if report.missing else "")
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
