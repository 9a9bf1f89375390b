"""Launchers: start the processes of a job (local ranks, SLURM srun/sbatch) and supervise them.

Never imports jax, so `scripts/run_distributed.py --help` answers at once.
"""
