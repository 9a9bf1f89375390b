"""Launchers: start the processes of a job and supervise them.

cli.py        the command line of scripts/run_distributed.py
local.py      --mode manual: this machine's ranks, their GPUs and coordinator
supervise.py  the rule: first failure wins, the rest are stopped (also for launch_multi_node.sh)
slurm.py      --mode slurm / create_slurm: srun, sbatch files, requeue near the time limit

Never imports jax, so `scripts/run_distributed.py --help` answers at once.
"""
