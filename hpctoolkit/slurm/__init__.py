"""Slurm: the typed job environment (`env`), the batch-script renderer (`render`, pure), submission
through sbatch or submitit (`handoff`), and the package's one runner of one-shot commands (`shell`).
The per-node role entry point is `hpctoolkit.roles`."""
