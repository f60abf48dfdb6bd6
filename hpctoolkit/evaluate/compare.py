"""Served against simulated acceptance of an exported draft, on the same prompts and tokens.

Convention: `*_incl_bonus` counts the target's bonus token per verification (EAGLE, vLLM);
`*_excl_bonus` does not (TorchSpec's `simulated_acc_len`). Both are reported for both sides.
Served and (replayed) simulated should agree closely: they differ only by bf16 kernels (vLLM's
CPU attention and GEMMs against transformers' and ours), a few percent; a larger gap means the
trainer and the server disagree about the draft, a bug to find.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hpctoolkit.errors import ConfigError
from hpctoolkit.evaluate.serve import serve
from hpctoolkit.evaluate.simulate import simulate
from hpctoolkit.train.plot import plot_acceptance

CONVENTION = (
    "acceptance_length_incl_bonus = 1 + accepted drafts per verification (EAGLE / vLLM); "
    "acc_len_excl_bonus = accepted drafts per verification (TorchSpec simulated_acc_len)"
)


def evaluate(
    export_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    prompts_token_ids: list[list[int]],
    *,
    num_speculative_tokens: int,
    max_tokens: int,
    plot_path: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Served and simulated acceptance of the exported draft on `prompts_token_ids`.

    Returns `served_acceptance_length`, `simulated_acceptance_length` (vLLM's schedule replayed)
    and `simulated_uniform_acceptance_length` (every start position), all incl. the bonus token;
    the `convention`; `served` / `simulated` blocks with both conventions and per-position
    rates; and `acceptance_length_gap` (served - simulated).
    """
    if not prompts_token_ids:
        raise ConfigError("evaluate needs at least one prompt")
    served = serve(
        export_dir,
        target_dir,
        prompts_token_ids,
        num_speculative_tokens=num_speculative_tokens,
        max_tokens=max_tokens,
    )
    outputs = served.pop("outputs")
    simulated = simulate(
        export_dir, target_dir, prompts_token_ids, outputs, num_speculative_tokens=num_speculative_tokens
    )
    result = {
        "served_acceptance_length": served["acceptance_length_incl_bonus"],
        "simulated_acceptance_length": simulated["acceptance_length_incl_bonus"],
        "simulated_uniform_acceptance_length": simulated["uniform"]["acceptance_length_incl_bonus"],
        "acceptance_length_gap": served["acceptance_length_incl_bonus"]
        - simulated["acceptance_length_incl_bonus"],
        "convention": CONVENTION,
        "num_speculative_tokens": num_speculative_tokens,
        "num_prompts": len(prompts_token_ids),
        "max_tokens": max_tokens,
        "served_per_position_acceptance": served["acceptance_rate_per_pos"],
        "simulated_per_position_acceptance": simulated["acceptance_rate_per_pos"],
        "served": served,
        "simulated": simulated,
    }
    if plot_path is not None:
        result["plot"] = str(
            plot_acceptance(
                Path(plot_path),
                acceptance_rate_per_pos=simulated["acceptance_rate_per_pos"],
                accuracy_per_pos=simulated["uniform"]["per_position_accuracy"],
                served_rate_per_pos=served["acceptance_rate_per_pos"],
                rate_label="simulated, vLLM schedule replayed",
                accuracy_label="simulated accuracy, every start",
                title=(
                    f"served {result['served_acceptance_length']:.2f} vs simulated "
                    f"{result['simulated_acceptance_length']:.2f} (incl. bonus, k={num_speculative_tokens})"
                ),
            )
        )
    return result
