"""Eagle3: one decoder layer over fused target aux states."""

from hpctoolkit.models.eagle3.config import Eagle3Config
from hpctoolkit.models.eagle3.model import Eagle3DecoderLayer, Eagle3DraftModel, Eagle3Output

__all__ = ["Eagle3Config", "Eagle3DecoderLayer", "Eagle3DraftModel", "Eagle3Output"]
