"""Kimi-K3 DSpark MLA draft.

`config` (`K3DSparkConfig`), `model` (`K3DSparkModel`) and `serving` (the family record). It
trains with DSpark's trainer and loss unchanged (`models/dspark/`; the registry says so). Import
the names from their modules; this package init imports nothing.
"""
