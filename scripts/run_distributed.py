r"""Run a script (default scripts/train.py) as many processes: locally, per host, under SLURM or on
Kubernetes.

Everything after `--` goes to the script unchanged.
One machine, 4 processes (GPUs split between them; on CPU set XLA_FLAGS yourself):
    python scripts/run_distributed.py --mode manual --world-size 4 -- --config configs/tiny.yaml
Many hosts by hand, one process per host (run on every host with its own --rank):
    python scripts/run_distributed.py --mode manual --rank 0 --world-size 2 \
        --coordinator 10.0.0.1:29500 -- --config configs/gpt2_124m.yaml
Many hosts, 8 processes per host (one per GPU): --node-rank K --nproc-per-node 8 --world-size 16
SLURM: inside salloc/sbatch runs srun; outside, writes an sbatch file and submits it:
    python scripts/run_distributed.py --mode slurm --nodes 2 --gpus-per-node 8 --follow -- \
        --config configs/gpt2_124m.yaml
    python scripts/run_distributed.py --mode create_slurm --nodes 2 --gpus-per-node 8 \
        --partition gpu --time 04:00:00 -- --config configs/gpt2_124m.yaml
    sbatch slurm_scripts/run_slurm.sh
Kubernetes: writes a JobSet (--indexed-job: an Indexed Job) whose pods run --mode k8s (docs/kubernetes.md):
    python scripts/run_distributed.py --mode create_k8s --num-nodes 4 --gpus-per-node 8 \
        --image REGISTRY/jaxtrain:1 --pvc runs:/runs -- --config configs/gpt2_124m.yaml --run_dir /runs/gpt2
    kubectl apply -f k8s/jaxtrain.yaml
Health check of a cluster: add --script scripts/test_distributed.py.

Output (manual): the first local rank prints to this terminal, stdout to stdout and stderr to
stderr; the others' lines go to stderr prefixed [rank R], or to --log-dir DIR/rank_R.log.
Exit code: 0 when every rank finished; else the first failing rank's own code (2 bad input,
3 hung, 4 non-finite, 75 pre-empted: checkpoint saved, run the same command again to resume),
or 128+N when it was killed by signal N; 128+N when this launcher itself got signal N (Ctrl-C:
130). Under SLURM it is srun's or the job's code.
"""

import sys

from jaxtrain.cluster.shutdown import exit_on_user_error
from jaxtrain.launch.cli import main

if __name__ == "__main__":
    sys.exit(exit_on_user_error(main)(sys.argv[1:]))
