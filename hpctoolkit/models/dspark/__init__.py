"""DSpark: DFlash with a low-rank markov head and a confidence head.

`config` (`DSparkConfig`), `heads`, `loss` (`dspark_loss`), `model` (`DSparkDraftModel`),
`trainer` (`DSparkTrainer`) and `serving` (the family record). Import the names from their
modules; this package init imports nothing.
"""
