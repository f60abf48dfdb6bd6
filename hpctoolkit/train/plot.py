# ruff: noqa: N806  -- shape-suffixed tensor names (hidden_BSH), per STYLE.md
"""The per-position acceptance plot written into the run directory."""

from __future__ import annotations

from pathlib import Path


def plot_acceptance(
    path: Path,
    *,
    acceptance_rate_per_pos: list[float],
    accuracy_per_pos: list[float],
    title: str,
    served_rate_per_pos: list[float] | None = None,
    rate_label: str = "P(first k drafts accepted)",
    accuracy_label: str = "per-position accuracy",
) -> Path:
    """Bar chart of P(first k+1 drafts accepted) and per-position accuracy (plus served, if given)."""
    # Here, not at the top: matplotlib is the heaviest import of the loop's, and only the end of
    # a run (and evaluation) draws; the backend must be chosen before pyplot is imported.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    P = len(acceptance_rate_per_pos)
    xs = list(range(1, P + 1))
    fig, ax = plt.subplots(figsize=(max(5.5, 0.6 * P + 3), 3.4), dpi=120)
    width = 0.4 if served_rate_per_pos is None else 0.27
    ax.bar([x - width / 2 for x in xs], acceptance_rate_per_pos, width, label=rate_label)
    ax.bar([x + width / 2 for x in xs], accuracy_per_pos, width, label=accuracy_label)
    if served_rate_per_pos is not None:
        k = len(served_rate_per_pos)
        ax.bar([x + 1.5 * width for x in xs[:k]], served_rate_per_pos, width, label="served (vLLM)")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("rate")
    ax.set_ylim(0, 1)
    ax.set_xticks(xs)
    ax.set_title(title, fontsize=8, wrap=True)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
