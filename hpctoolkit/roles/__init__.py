"""The roles of a run, one process each, and the code that starts them.

`python -m hpctoolkit.roles ROLE RECIPE [section.key=value ...]` runs one role: `check`, `master`,
`engine-leader`, `engine-follower`, `trainer` (placed by the plan) and `evaluate` (after the
trainers, on trainer rank 0's node). A Slurm job's batch script starts one per step; the embedded run
(`local.run_local`) starts the same processes on this machine. Both meet through the run directory
(`hpctoolkit.rundir.layout`) and the Mooncake master, so `make run` runs the code a cluster runs.
All three ways in (the embedded launcher, the batch script, submitit's tasks) go through the same
phases, `hpctoolkit.plan.lifecycle`.

Modules: `context` (where this process runs: plan, node, run directory, addresses), `master`,
`engines`, `trainer`, `evaluate` (the roles), `dispatch` (role selection, dry mode, submitit's
task entry and its part of the lifecycle, `follow`), `local` (the embedded launcher), `waits` (bounded waits and stop signals).
Import the names from their modules; this package init imports nothing.
"""
