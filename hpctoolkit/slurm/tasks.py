"""The task layout of a submitit job: which of the plan's processes each task runs. Pure.

submitit gives every node the same task count and installs its SIGUSR2 handler in every task, but
only global task 0's handler requeues the job, and a role that installs its own (the trainers, the
engine leaders) replaces it. So task 0 runs a process that leaves SIGUSR2 to submitit: the Mooncake
master where the plan places it first on node 0, else (an external master, `store.master_address`)
a **watcher** in the master's slot (`roles.master.run_watcher`), which waits for the run's end.

Both the submitting side (`slurm.handoff`, for the task count) and every task (`roles.dispatch`, for
its own process) read the layout from here, so neither imports the other.
"""

from __future__ import annotations

from hpctoolkit.plan.placement import ROLE_MASTER, Plan, Process

# What global task 0 runs when the plan's first process on node 0 would replace submitit's handler.
WATCHER = "watcher"


def needs_watcher(plan: Plan) -> bool:
    """Task 0 (node 0, local id 0) must leave SIGUSR2 to submitit: only the master role does."""
    here = plan.on_node(0)
    return not here or here[0].role != ROLE_MASTER


def task_process(plan: Plan, node: int, local_id: int) -> Process | str | None:
    """What task `local_id` of node `node` runs under submitit: one of the plan's processes on that
    node, `WATCHER` (task 0 when `needs_watcher`), or None (a spare task)."""
    here = plan.on_node(node)
    if node == 0 and needs_watcher(plan):
        if local_id == 0:
            return WATCHER
        local_id -= 1
    return here[local_id] if local_id < len(here) else None


def tasks_per_node(plan: Plan) -> int:
    """submitit's tasks per node: the busiest node's processes, node 0's watcher counted."""
    return max(
        len(plan.on_node(n)) + (1 if n == 0 and needs_watcher(plan) else 0) for n in range(plan.num_nodes)
    )
