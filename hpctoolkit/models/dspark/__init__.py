"""DSpark: DFlash with a low-rank markov head and a confidence head."""

from hpctoolkit.models.dspark.config import DSparkConfig
from hpctoolkit.models.dspark.heads import ConfidenceHead, MarkovHead
from hpctoolkit.models.dspark.loss import DSparkLoss, dspark_loss
from hpctoolkit.models.dspark.model import DSparkDraftModel, DSparkOutput

__all__ = [
    "ConfidenceHead",
    "DSparkConfig",
    "DSparkDraftModel",
    "DSparkLoss",
    "DSparkOutput",
    "MarkovHead",
    "dspark_loss",
]
