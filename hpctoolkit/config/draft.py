"""What a draft config JSON names that a recipe is checked against: the target layers it reads.

Here, at the foundation, rather than with the recipe's couplings: the evaluation's replay reads
an exported draft's layers too, and the draft config is a plain dict whichever family wrote it.
"""

from __future__ import annotations

from typing import Any


def draft_target_layer_ids(draft: dict[str, Any]) -> list[int] | None:
    """The 0-based target layers a draft config reads, whatever its family spells them."""
    for holder in (draft.get("dflash_config") or {}, draft):
        for name in ("target_layer_ids", "dspark_target_layer_ids"):
            if holder.get(name) is not None:
                return [int(i) for i in holder[name]]
    eagle = draft.get("eagle_aux_hidden_state_layer_ids") or (draft.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    if eagle is not None:
        # Eagle3 names capture ids (state after layer k-1), one above the layer index.
        return [int(i) - 1 for i in eagle]
    return None
