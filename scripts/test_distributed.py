r"""Cluster health check: can this allocation train, and if not, which host is broken and why.

Checks environment, network, jax.distributed init, software, devices, collectives, the GPU-only
kernels on each GPU (--kernels), a matmul checksum voted across devices, all-to-all and the experts'
exchange, bandwidth (an all-reduce sweep as nccl-tests, neighbouring pairs of hosts, each collective
against the planner's --target) and shared storage; see jaxtrain/health/ and docs/health_check.md.
Process 0 prints a table and one verdict line a host; --json FILE writes every figure, `bad_hosts` and
`bad_processes` (a process that fails before it can reach process 0 writes FILE.process-N.json
instead). Exit 0 healthy, 1 a check failed, 2 bad arguments. Every wait is bounded
(--network_timeout 60, --init_timeout 120, --step_timeout 120 seconds), so it never hangs.

One process (this machine's devices):
    python scripts/test_distributed.py --json health.json
One host, N processes (on CPU also set XLA_FLAGS=--xla_force_host_platform_device_count=2):
    python scripts/run_distributed.py --mode manual --world-size 4 \
        --script scripts/test_distributed.py -- --json health.json
Many hosts, by hand, one line per host (process 0 on the host the coordinator address names):
    JAX_COORDINATOR_ADDRESS=node0:29500 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 \
        python scripts/test_distributed.py --checkpoint_dir /shared/ckpt --json health.json
    JAX_COORDINATOR_ADDRESS=node0:29500 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=1 \
        python scripts/test_distributed.py --checkpoint_dir /shared/ckpt --json health.json
  or per host: python scripts/run_distributed.py --mode manual --rank R --world-size 2 \
        --coordinator node0:29500 --script scripts/test_distributed.py -- --checkpoint_dir /shared/ckpt
SLURM (inside an allocation; one task per node, or one per GPU):
    srun --nodes 8 --ntasks-per-node 1 python scripts/test_distributed.py \
        --checkpoint_dir /shared/ckpt --expected_devices_per_host 8 --max_bytes 1G --target h100 \
        --json health.json
    python scripts/run_distributed.py --mode slurm --nodes 8 --gpus-per-node 8 \
        --script scripts/test_distributed.py -- --checkpoint_dir /shared/ckpt --json health.json
    sbatch --exclude "$(jq -r '.bad_hosts | join(",")' health.json)" ...   # then skip the bad nodes
"""

import sys

from jaxtrain.cluster.shutdown import exit_on_user_error
from jaxtrain.health.cli import main

if __name__ == "__main__":
    sys.exit(exit_on_user_error(main)(sys.argv[1:], __doc__ or ""))
