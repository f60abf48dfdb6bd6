"""Recipes: typed sections (`schema`), loading with overrides (`load`), and the cross-section
rules (`couplings`). Import the names from their modules; this package init imports nothing.
"""
