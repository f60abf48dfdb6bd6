"""The trainer machinery every draft family shares: the base class FSDP wraps (`base`) and
building a family's trainer from its draft config and the target (`build`).

Each family's own trainer lives in its folder (`models/<family>/trainer.py`) and is named by the
one registry, `models.registry`. Import the names from their modules; this package init imports
nothing.
"""
