"""Regeneration replicas: several generating engines on one engine's GPU (`engine.regenerate_replicas`).

A small target leaves a GPU mostly idle while one engine's scheduler works on one CPU core, so an
engine leader whose engine has one GPU may regenerate its rows with N generating engines side by
side: replica `j` answers rows `j::N` (with the seeds those rows have in the whole share), each
with `1/N` of the engine's `gpu_memory_utilization`, started one at a time (vLLM sizes its cache
from the memory it finds free), and `merge_replicas` puts the rows back in order: the same rows,
in the same order, as one engine's. Each replica of a `builtin:magpie` run synthesizes the same
pool (same seeds) and fills its own rows, as engine leaders do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hpctoolkit.errors import DataIntegrityError
from hpctoolkit.roles.child import Child
from hpctoolkit.roles.context import NodeContext

# Leaders: how long a generating process (one engine's, or a replica's) may take to exit after
# its result: vLLM's shutdown of an engine spanning nodes can wait forever.
REGENERATE_LINGER_S = 20.0


def merge_replicas(parts: list[dict[str, Any]], total: int) -> dict[str, Any]:
    """One result from the replicas' (`parts[j]` regenerated rows `j::len(parts)` of `total`): the samples
    back in the rows' order, the counts summed. Each replica synthesized the same pool
    (`data.synth`: same seeds), so the synthesis report is the first replica's."""
    from hpctoolkit.engine.regenerate import RegenReport

    n = len(parts)
    samples: list[Any] = [None] * total
    for j, part in enumerate(parts):
        if len(part["samples"]) != len(range(j, total, n)):
            raise DataIntegrityError(
                f"regeneration replica {j} of {n} returned {len(part['samples'])} rows, "
                f"expected {len(range(j, total, n))}"
            )
        samples[j::n] = part["samples"]
    reports = [RegenReport(**p["report"]) for p in parts]
    report = {k: sum(int(getattr(r, k)) for r in reports) for k in reports[0].to_dict()}
    return {"samples": samples, "report": report, "synthesized": parts[0].get("synthesized")}


def replicated(
    ctx: NodeContext,
    engine: int,
    entry: Callable[..., dict[str, Any]],
    args: tuple[Any, ...],
    replicas: int,
) -> dict[str, Any]:
    """`replicas` generating engines on this engine's GPU, replica `j` on rows `j::replicas` of
    `args`' rows (each a `Child` running `entry(*args, replica)`), started one after another
    (`engine.regenerate.Gate`) and run side by side; one result."""
    target_dir, rows, spec, sampling, max_prompt, max_len, llm_kwargs, env = args
    llm_kwargs = dict(llm_kwargs)
    from hpctoolkit.engine.env import detect_backend

    if detect_backend() == "cuda":
        # vLLM's share of the GPU, split: the replicas hold together what one engine would.
        share = float(llm_kwargs.get("gpu_memory_utilization", 0.9))
        llm_kwargs["gpu_memory_utilization"] = share / replicas
    gates = [ctx.run.logs / f".regenerate-engine{engine}-replica{j}.started" for j in range(replicas)]
    for g in gates:
        g.unlink(missing_ok=True)
    children = []
    try:
        for j in range(replicas):
            replica = {
                "row_ids": list(range(j, len(rows), replicas)),
                "after": None if j == 0 else str(gates[j - 1]),
                "started": str(gates[j]),
            }
            part = (
                target_dir,
                rows[j::replicas],
                spec,
                sampling,
                max_prompt,
                max_len,
                llm_kwargs,
                env,
                replica,
            )
            children.append(Child(f"regenerate-replica{j}", entry, part, ctx.run.logs))
        parts = [c.result(linger_s=REGENERATE_LINGER_S) for c in children]
    finally:
        for c in children:  # a failed replica: the others (running, or waiting for its gate) end too
            c.kill_tree()
    return merge_replicas(parts, len(rows))
