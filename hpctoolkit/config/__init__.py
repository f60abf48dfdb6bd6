"""Recipes: typed sections, loading with overrides, and the cross-section couplings."""

from hpctoolkit.config.load import compose, load_recipe, to_yaml
from hpctoolkit.config.schema import RecipeConfig

__all__ = ["RecipeConfig", "compose", "load_recipe", "to_yaml"]
