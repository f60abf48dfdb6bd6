"""DFlash: block drafting from captured target layers with dual-source attention.

`config` (`DFlashConfig`), `layout` (block layout, anchors, masks), `loss`, `model`
(`DFlashDraftModel`) and `serving` (the family record). Import the names from their modules; this
package init imports nothing.
"""
