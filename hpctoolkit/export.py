"""Moved to `hpctoolkit.models.export` (`python -m hpctoolkit.models.export CHECKPOINT OUT_DIR`).

This re-export lasts only until `train/loop.py` imports `export_draft` from there; nothing else
may use it.
"""

from hpctoolkit.models.export import export_draft

__all__ = ["export_draft"]
