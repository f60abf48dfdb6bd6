"""Placement: which process runs on which node and GPUs (`make_plan`), from the cluster section
(`config.ClusterConfig`) and the engine / training / store sections. Pure."""

from hpctoolkit.plan.placement import Plan, make_plan

__all__ = ["Plan", "make_plan"]
