"""What this process sees of the inputs its recipe names: each hashed now (`measure`), for
`rundir.inputs_record` to pin at a run's start and check at every later attempt and role start.

Which inputs is `recipe.schema.named_inputs`'s, how each is pinned `config.pinned_inputs`'s (pure); this module finds the files:
a target directory's listing, a packaged target's installed GGUF file, an evaluation set's file in
its installed wheel (keyed `wheel:<distribution>/<file>`: each node has its own site-packages).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hpctoolkit.config.pinned_inputs import (
    EVAL_SET,
    EVAL_SET_FILES,
    PACKAGED,
    TARGET_DIR,
    Named,
    target_files,
)
from hpctoolkit.recipe.schema import RecipeConfig, named_inputs
from hpctoolkit.rundir.inputs_record import Pin, sha256_file


def _entry(n: Named, path: Path, hashed: bool = True) -> dict[str, Any]:
    size = path.stat().st_size
    return {"knob": n.knob, "what": n.what, "sha256": sha256_file(path) if hashed else None, "bytes": size}


def _files(n: Named) -> Iterator[tuple[str, Path, bool]]:
    """`(name in the record, path here, hashed)` of each file input `n` stands for, as found now
    (a named file that is missing yields nothing: its absence is then the change)."""
    if n.kind == TARGET_DIR:
        root = Path(n.ref)
        if root.is_dir():
            names = [p.name for p in root.iterdir() if p.is_file()]
            for name, hashed in target_files(names):
                yield f"{n.ref.rstrip('/')}/{name}", root / name, hashed
        return
    if n.kind == PACKAGED:
        from hpctoolkit.targets import packaged

        yield n.ref, packaged.source_file(packaged.lookup(n.ref)), True
        return
    if n.kind == EVAL_SET:
        found = _eval_set_file(n.ref)
        if found is not None:
            yield found
        return
    path, name = Path(n.ref), n.ref
    if path.is_dir():  # a draft config given as its directory
        path, name = path / "config.json", f"{n.ref.rstrip('/')}/config.json"
    if path.is_file():
        yield name, path, True


def _eval_set_file(name: str) -> tuple[str, Path, bool] | None:
    """The installed wheel's file of evaluation set `name`, or None where it is not installed."""
    if name not in EVAL_SET_FILES:
        return None
    dist, rel = EVAL_SET_FILES[name]
    try:
        path = Path(str(importlib.metadata.distribution(dist).locate_file(rel)))
    except importlib.metadata.PackageNotFoundError:
        return None
    return (f"wheel:{dist}/{rel}", path, True) if path.is_file() else None


def measure(cfg: RecipeConfig, recipe_yaml: str) -> Pin:
    """Hash every input `cfg` names, as this process sees it now."""
    files: dict[str, dict[str, Any]] = {}
    for n in named_inputs(cfg):
        for name, path, hashed in _files(n):
            files[name] = _entry(n, path, hashed)
    return Pin(recipe_yaml, files)
