"""Eagle3: one decoder layer over fused target aux states.

`config` (`Eagle3Config`), `loss` (`eagle3_step_loss`), `model` (`Eagle3DraftModel`), `trainer`
(`Eagle3Trainer`) and `serving` (the family record). Import the names from their modules; this
package init imports nothing.
"""
