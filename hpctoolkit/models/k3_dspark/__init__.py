"""Kimi-K3 DSpark MLA draft."""

from hpctoolkit.models.k3_dspark.config import K3DSparkConfig
from hpctoolkit.models.k3_dspark.model import K3DSparkModel

__all__ = ["K3DSparkConfig", "K3DSparkModel"]
