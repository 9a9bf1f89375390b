"""Cluster health check: can this allocation train, and if not, which host is broken and why.

Checks environment, network, jax.distributed init, software, devices, collectives, all-reduce
bandwidth (nccl-tests algbw/busbw, then neighbouring pairs of hosts) and shared storage; see
jaxtrain/health/. Process 0 prints a table; --json FILE writes every figure, `bad_hosts` and
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
        --checkpoint_dir /shared/ckpt --expected_devices_per_host 8 --max_bytes 1G --json health.json
    python scripts/run_distributed.py --mode slurm --nodes 8 --gpus-per-node 8 \
        --script scripts/test_distributed.py -- --checkpoint_dir /shared/ckpt --json health.json
    sbatch --exclude "$(jq -r '.bad_hosts | join(",")' health.json)" ...   # then skip the bad nodes
"""

from __future__ import annotations

import argparse
import re
import sys

from jaxtrain.cluster.shutdown import exit_on_user_error
from jaxtrain.config import DistConfig
from jaxtrain.health import runner as health
from jaxtrain.parser import Parser as _Parser

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def _bytes(text: str) -> int:
    """'4M', '4MiB', '1G' or '65536' -> bytes."""
    m = re.fullmatch(r"(\d+)\s*([KMG]?)(i?B)?", text.strip(), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size; write e.g. 65536, 64K or 4M")
    return int(m[1]) * _UNITS[m[2].upper()]


def parse_args(argv: list[str]) -> tuple[health.HealthOptions, DistConfig]:
    """Command line -> health options and the distributed settings (unset = detect from env)."""
    d, h = DistConfig(), health.HealthOptions()
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", dest="json_path", default=h.json_path, help="write the full report here")
    p.add_argument("--checkpoint_dir", default=h.checkpoint_dir, help="directory every host must share")
    p.add_argument("--max_bytes", type=_bytes, default=h.max_bytes, help="largest all-reduce size (4M)")
    p.add_argument("--iters", type=int, default=h.iters, help="timed all-reduces per size")
    p.add_argument("--expected_devices_per_process", type=int, default=h.expected_devices_per_process)
    p.add_argument("--expected_devices_per_host", type=int, default=h.expected_devices_per_host)
    p.add_argument("--min_busbw_gbps", type=float, default=h.min_busbw_gbps, help="fail below this")
    p.add_argument(
        "--slow_host_factor", type=float, default=h.slow_host_factor, help="0.5: fail a host at half speed"
    )
    p.add_argument("--network_timeout", type=float, default=h.network_timeout, help="seconds")
    p.add_argument("--step_timeout", type=float, default=h.step_timeout, help="seconds per later step")
    # Shorter than training's default: a health check should say soon who never joined.
    p.add_argument("--init_timeout", type=int, default=120, help="seconds for all to join")
    p.add_argument("--coordinator_address", default=d.coordinator_address, help="HOST:PORT")
    p.add_argument("--num_processes", type=int, default=d.num_processes)
    p.add_argument("--process_id", type=int, default=d.process_id)
    p.add_argument("--local_device_ids", default=d.local_device_ids, help="e.g. 0,1")
    args = vars(p.parse_args(argv))
    dist = DistConfig(**{k: args.pop(k) for k in list(args) if k in DistConfig.__dataclass_fields__})
    return health.HealthOptions(**args), dist


@exit_on_user_error
def main(argv: list[str]) -> int:
    opts, dist = parse_args(argv)
    return health.run(opts, dist)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
