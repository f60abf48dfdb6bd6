"""Per-family losses as pure tensor functions, plus the `LossParts` every trainer returns.

Normalisation contract (all families): a loss returns a weighted *sum* over its supervised
positions (`numerator`, carries the graph) and the sum of those weights (`denominator`). The
training loop all-reduces only the denominator and backpropagates
`numerator / global_denominator * world_size`; FSDP then averages gradients over ranks, so the
effective gradient is that of `sum_ranks(numerator) / sum_ranks(denominator)`, independent of how
the global batch is split over ranks.
"""

from hpctoolkit.train.losses.common import LossParts, acceptance_from_matches
from hpctoolkit.train.losses.dflash import dflash_decay_gamma, dflash_loss
from hpctoolkit.train.losses.dspark import DSPARK_BCE_W, DSPARK_CE_W, DSPARK_L1_W, dspark_loss
from hpctoolkit.train.losses.eagle3 import EAGLE3_STEP_DECAY, eagle3_step_loss

__all__ = [
    "DSPARK_BCE_W",
    "DSPARK_CE_W",
    "DSPARK_L1_W",
    "EAGLE3_STEP_DECAY",
    "LossParts",
    "acceptance_from_matches",
    "dflash_decay_gamma",
    "dflash_loss",
    "dspark_loss",
    "eagle3_step_loss",
]
