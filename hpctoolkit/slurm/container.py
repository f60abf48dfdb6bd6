"""Run a job's steps inside the Apptainer image: which host paths to bind, and the command prefix.

Pure: config in, strings out (no subprocess). `render.py` puts the prefix into the batch script;
the submitit path can wrap its command the same way with `command_prefix`.

A step needs inside the container what the recipe names on the host: the output directory, the
target model, the prompts, the draft config (and the recipe itself). Apptainer mounts $HOME, /tmp
and the working directory by default, but not a site's /scratch or /models, where such a path
"does not exist" inside. Each is bound, at the same path, only where it is outside the image:
* a relative path lies in the working directory (the submit directory), which Apptainer mounts;
* a path under `IMAGE_ROOTS` is the image's own copy (e.g. /opt/hpctoolkit/recipes/...); binding
  the host's over it would hide it;
* a value that is no path (`builtin:tiny`) is not a file at all.
A path under another bound path is covered by it. Apptainer's `--bind` splits on ',' and ':', so
such a path cannot be bound and is refused with the key that names it.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from hpctoolkit.errors import ConfigError

if TYPE_CHECKING:
    from hpctoolkit.recipe.schema import RecipeConfig

# Where `make image` writes the image with its defaults (VLLM_VERSION=0.32.0,
# IMAGE_TAG_SUFFIX=-pp-export), and so the image the launchers use by default.
DEFAULT_IMAGE = "images/hpctoolkit-vllm-0.32.0-pp-export.sif"
# What the image itself ships (apptainer/hpctoolkit.def's %files destination).
IMAGE_ROOTS = ("/opt/hpctoolkit",)
# The config keys whose values steps read as host paths; the output directory first (it is the one
# a step creates, so the batch script makes it before binding it).
BIND_KEYS = ("paths.output_dir", "paths.target_model", "data.prompts", "draft.config")
OUTPUT_KEY = "paths.output_dir"
APPTAINER_EXEC = ("apptainer", "exec", "--nv")
IMAGE_PYTHON = "python3"


def in_image(path: str) -> bool:
    """Whether absolute `path` is the image's own (under one of `IMAGE_ROOTS`)."""
    norm = posixpath.normpath(path)
    return any(norm == root or norm.startswith(root + "/") for root in IMAGE_ROOTS)


def needs_bind(value: str) -> bool:
    """Whether a path value must be bound: absolute and outside the image (see the module doc)."""
    return value.startswith("/") and not in_image(value)


def bind_paths(values: Mapping[str, str | None] | Iterable[tuple[str, str | None]]) -> list[str]:
    """The host paths to bind for `key -> value` (unset values skipped), in order, normalized,
    without duplicates or paths under another one bound. Raises ConfigError for a path that
    `--bind` cannot carry."""
    items = values.items() if isinstance(values, Mapping) else values
    out: list[str] = []
    for key, value in items:
        if value is None or not needs_bind(str(value)):
            continue
        path = posixpath.normpath(str(value))
        if "," in path or ":" in path:
            raise ConfigError(f"{key}={value!r}: apptainer --bind cannot carry a path with ',' or ':'")
        out.append(path)
    return [p for p in dict.fromkeys(out) if not any(_under(p, q) for q in out if q != p)]


def _under(path: str, parent: str) -> bool:
    return parent == "/" or path.startswith(parent.rstrip("/") + "/")


def config_paths(cfg: RecipeConfig, *, skip: str | None = None) -> list[tuple[str, str | None]]:
    """`(key, value)` of every `BIND_KEYS` entry of `cfg`; a value equal to `skip` (a placeholder
    for one given later) is left unset."""
    out = []
    for key in BIND_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        out.append((key, None if value is None or value == skip else str(value)))
    return out


def exec_prefix(binds: Sequence[str]) -> list[str]:
    """`apptainer exec --nv --bind P ...`, without the image."""
    return [*APPTAINER_EXEC, *(arg for p in binds for arg in ("--bind", p))]


def container_prefix(image: str, binds: Sequence[str], *, python: str = IMAGE_PYTHON) -> list[str]:
    """The argv prefix that runs `python` inside `image` with `binds` mounted at the same paths."""
    return [*exec_prefix(binds), image, python]


def command_prefix(cfg: RecipeConfig, *, recipe_path: str | None = None) -> list[str] | None:
    """The prefix a step of `cfg` runs its `-m MODULE ...` behind: the image's python with what
    the recipe names bound, or None when `cluster.container` is unset (the python on PATH)."""
    image = cfg.cluster.container
    if not image:
        return None
    pairs = config_paths(cfg)
    if recipe_path is not None:
        pairs.append(("recipe", recipe_path))
    return container_prefix(image, bind_paths(pairs))
