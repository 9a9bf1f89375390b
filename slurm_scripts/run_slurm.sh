#!/bin/bash
# Train jaxtrain under SLURM, every process started by srun. Submit with:
#     sbatch slurm_scripts/run_slurm.sh
# Made by: python scripts/run_distributed.py --mode create_slurm --nodes 2 --gpus-per-node 8 --cpus-per-task 16 --time 04:00:00 --workdir . --sbatch-script slurm_scripts/run_slurm.sh -- --config configs/gpt2_124m.yaml --run_dir runs/gpt2_124m
#SBATCH --job-name=jaxtrain
#SBATCH --nodes=2
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=16
#SBATCH --time=04:00:00
#SBATCH --chdir=.
#SBATCH --output=slurm_scripts/logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@90
#SBATCH --requeue
set -euo pipefail

if [[ ! -f scripts/train.py ]]; then echo "error: scripts/train.py not found in $PWD" >&2; exit 2; fi
echo "jaxtrain: job ${SLURM_JOB_ID} on ${SLURM_JOB_NODELIST}, $(date)"

# SLURM sends USR1 90 s before the time limit. Pass it to every task: they
# agree on a step, save a checkpoint there and exit 75; then the job requeues itself and the
# next start resumes. This gives the save the whole warning time. SLURM pre-emption and
# `scontrol requeue` send SIGTERM instead, which saves the same way but must finish within
# KillWait seconds (scontrol show config | grep KillWait; default 30) before SIGKILL.
asked=0
trap 'asked=1; echo "jaxtrain: time limit near, asking the tasks to save"; scancel --signal=USR1 "${SLURM_JOB_ID}"' USR1
srun --kill-on-bad-exit=1 .venv/bin/python scripts/train.py --config configs/gpt2_124m.yaml --run_dir runs/gpt2_124m &
srun_pid=$!
# A trapped signal ends `wait` early; keep waiting until srun itself has finished.
while true; do
    rc=0; wait "$srun_pid" || rc=$?
    kill -0 "$srun_pid" 2>/dev/null || break
done
# Requeue after a save (exit 75), or near the limit even if a task died on the way out.
if [[ $rc -eq 75 || $asked -eq 1 ]]; then
    echo "jaxtrain: pre-empted, requeueing job ${SLURM_JOB_ID}"
    scontrol requeue "${SLURM_JOB_ID}" || true  # already requeued when SLURM pre-empted it
fi
exit "$rc"
