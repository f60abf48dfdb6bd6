"""Placement: which process runs on which node and GPUs (`placement.make_plan`), from the cluster
section (`config.ClusterConfig`) and the engine / training / store sections. Pure.
"""
