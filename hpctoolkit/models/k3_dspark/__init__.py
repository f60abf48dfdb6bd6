"""Kimi-K3 DSpark MLA draft.

`config` (`K3DSparkConfig`), `model` (`K3DSparkModel`) and `serving` (the family record). Import
the names from their modules; this package init imports nothing.
"""
