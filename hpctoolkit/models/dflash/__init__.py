"""DFlash: block drafting from captured target layers with dual-source attention.

`config` (`DFlashConfig`), `layout` (block layout, anchors, masks), `loss` (`dflash_loss`),
`model` (`DFlashDraftModel`), `trainer` (`DFlashTrainer`) and `serving` (the family record).
Import the names from their modules; this package init imports nothing.
"""
