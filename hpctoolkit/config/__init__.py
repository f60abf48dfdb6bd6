"""Recipes: typed sections, loading with overrides, and the cross-section couplings.

Names resolve on first use, so that a section config (`store/config.py`, ...) can import
`hpctoolkit.config.fields` without initialising the schema that imports it back.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "compose": "hpctoolkit.config.load",
    "load_recipe": "hpctoolkit.config.load",
    "to_yaml": "hpctoolkit.config.load",
    "RecipeConfig": "hpctoolkit.config.schema",
}
__all__ = ["RecipeConfig", "compose", "load_recipe", "to_yaml"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hpctoolkit.config' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
