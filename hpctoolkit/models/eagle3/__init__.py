"""Eagle3: one decoder layer over fused target aux states.

`config` (`Eagle3Config`), `model` (`Eagle3DraftModel`) and `serving` (the family record). Import
the names from their modules; this package init imports nothing.
"""
