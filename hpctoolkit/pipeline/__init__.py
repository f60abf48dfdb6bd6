"""Orchestration: run the whole job on one machine (`local.py`), phase by phase."""
