"""The import rules of the package, checked from its source (every import counts, those inside
functions too) and by importing with the heavy parts blocked.

* No import cycles among `hpctoolkit` modules. Importing `a.b.c` runs the package inits `a.b` too,
  so those count as edges; package inits import nothing, so they close no cycle.
* The pure rooms (the layout and ownership arithmetic, the manifest, the placement plan, the batch
  script rendering, the run-directory layout) reach no torch.distributed, vllm, mooncake or
  subprocess, directly or through another module of ours.
* `models` and `train` (what the GPU machine runs) import with vllm and mooncake blocked.
* `models` reaches nothing of `train`: the families register from below, `train` looks them up.
* Production code imports no test helper: nothing outside `hpctoolkit.testing` imports it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "hpctoolkit"
FORBIDDEN_IN_PURE = ("torch.distributed", "vllm", "mooncake", "subprocess")
PURE_ROOMS = (
    "hpctoolkit.capture.layout",
    "hpctoolkit.capture.manifest",
    "hpctoolkit.plan.placement",
    "hpctoolkit.plan.lifecycle",
    "hpctoolkit.slurm.render",
    "hpctoolkit.slurm.tasks",
    "hpctoolkit.rundir.layout",
)
GPU_ROOMS = ("hpctoolkit.models", "hpctoolkit.train")
TEST_HELPERS = "hpctoolkit.testing"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """Every module `name` imports anywhere in its source (ours and others', by full name)."""
    path = MODULES[name]
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            for a in node.names:
                full = f"{module}.{a.name}"
                found.add(full if full in MODULES else module)
    return found


def _edges(name: str) -> set[str]:
    """Our modules that importing `name` runs: each import and the package inits above it."""
    out = set()
    for target in _imports(name):
        if target not in MODULES:
            continue
        parts = target.split(".")
        for k in range(2, len(parts) + 1):
            mod = ".".join(parts[:k])
            if mod in MODULES and mod != name and not name.startswith(mod + "."):
                out.add(mod)
    return out


GRAPH = {m: _edges(m) for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_package_inits_import_nothing_lazily():
    for name, path in MODULES.items():
        if path.name == "__init__.py":
            assert "__getattr__" not in path.read_text(), f"{name} resolves names lazily"


def _reach(name: str) -> set[str]:
    seen, todo = {name}, [name]
    while todo:
        for m in GRAPH[todo.pop()]:
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def test_models_never_reach_train():
    """Families register from below (`models.common.trainer`, `models.registry`): `train/` looks
    them up, and nothing in `models/`, typing-only imports included, leads into `train/`."""
    bad = sorted(
        f"{mod} reaches {m}"
        for mod in MODULES
        if mod == "hpctoolkit.models" or mod.startswith("hpctoolkit.models.")
        for m in _reach(mod)
        if m == "hpctoolkit.train" or m.startswith("hpctoolkit.train.")
    )
    assert bad == []


def _test_helper_imports(modules: dict[str, set[str]]) -> list[str]:
    """`a imports b` for each module `a` outside the test helpers that imports one of them."""

    def helper(m: str) -> bool:
        return m == TEST_HELPERS or m.startswith(TEST_HELPERS + ".")

    return sorted(
        f"{a} imports {b}" for a, imps in modules.items() if not helper(a) for b in imps if helper(b)
    )


def test_production_code_imports_no_test_helper():
    assert _test_helper_imports({m: _imports(m) for m in MODULES}) == []


def test_the_test_helper_rule_sees_an_import():
    found = {
        "hpctoolkit.data.prompts": {"hpctoolkit.testing.tiny_target"},
        "hpctoolkit.testing.a": {TEST_HELPERS},
    }
    assert _test_helper_imports(found) == ["hpctoolkit.data.prompts imports hpctoolkit.testing.tiny_target"]


def test_config_is_the_foundation():
    # config/ holds the field kinds every section is declared with, so it stands below every room
    # that owns a section: it imports no room of ours but errors (issue 45 item 2).
    above = sorted(
        f"{mod} imports {imp}"
        for mod in MODULES
        if mod.startswith("hpctoolkit.config.")
        for imp in GRAPH[mod]
        if not imp.startswith("hpctoolkit.config") and imp != "hpctoolkit.errors"
    )
    assert above == []


@pytest.mark.parametrize("room", PURE_ROOMS)
def test_pure_rooms_import_nothing_heavy(room):
    bad = sorted(
        f"{mod} imports {imp}"
        for mod in _reach(room)
        for imp in _imports(mod)
        if any(imp == f or imp.startswith(f + ".") for f in FORBIDDEN_IN_PURE)
    )
    assert bad == []


BLOCKER = r"""
import importlib, pkgutil, sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("vllm", "mooncake"):
            raise ImportError(f"{name} is blocked by the import-rules test")
        return None

sys.meta_path.insert(0, Block())
room = importlib.import_module(sys.argv[1])
names = [sys.argv[1]] + [m.name for m in pkgutil.walk_packages(room.__path__, sys.argv[1] + ".")]
for name in names:
    if not name.endswith("__main__"):
        importlib.import_module(name)
print(len(names))
"""


@pytest.mark.parametrize("room", GPU_ROOMS)
def test_gpu_rooms_import_without_vllm_or_mooncake(room):
    r = subprocess.run(
        [sys.executable, "-c", BLOCKER, room],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout.strip()) > 3


def test_the_heavy_import_check_sees_through_modules():
    # The launcher spawns processes: the check must see it from a module that imports it.
    assert "subprocess" in _imports("hpctoolkit.roles.local")
    assert "hpctoolkit.roles.local" in _reach("hpctoolkit.submit")
