"""Target models by recipe name: tiny random ones built locally, real ones from PyPI wheels, paths."""
