"""The command line of scripts/test_distributed.py (its docstring is the usage): parse the flags
into the health options and the distributed settings, run the check (jaxtrain/health/runner.py).
"""

from __future__ import annotations

import argparse
import re

from jaxtrain.config import DistConfig
from jaxtrain.health import runner as health
from jaxtrain.parser import Parser

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def _bytes(text: str) -> int:
    """'4M', '4MiB', '1G' or '65536' -> bytes."""
    m = re.fullmatch(r"(\d+)\s*([KMG]?)(i?B)?", text.strip(), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size; write e.g. 65536, 64K or 4M")
    return int(m[1]) * _UNITS[m[2].upper()]


def parse_args(argv: list[str], usage: str = "") -> tuple[health.HealthOptions, DistConfig]:
    """Command line -> health options and the distributed settings (unset = detect from env)."""
    d, h = DistConfig(), health.HealthOptions()
    p = Parser(description=usage, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", dest="json_path", default=h.json_path, help="write the full report here")
    p.add_argument("--checkpoint_dir", default=h.checkpoint_dir, help="directory every host must share")
    p.add_argument(
        "--max_bytes", type=_bytes, default=h.max_bytes, help="largest collective size (4M; 1G on a cluster)"
    )
    p.add_argument("--iters", type=int, default=h.iters, help="timed all-reduces per size")
    p.add_argument("--expected_devices_per_process", type=int, default=h.expected_devices_per_process)
    p.add_argument("--expected_devices_per_host", type=int, default=h.expected_devices_per_host)
    p.add_argument("--min_busbw_gbps", type=float, default=h.min_busbw_gbps, help="fail below this")
    p.add_argument(
        "--slow_host_factor", type=float, default=h.slow_host_factor, help="0.5: fail a host at half speed"
    )
    p.add_argument(
        "--kernels",
        default=h.kernels,
        help="auto: check the GPU-only kernels on each GPU; on: every kernel; off",
    )
    p.add_argument("--target", default=h.target, help="planner target to compare busbw with (h100, h200...)")
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


def main(argv: list[str], usage: str = "") -> int:
    """Exit code: 0 healthy, 1 a check failed (health.run); bad arguments raise ArgumentError."""
    opts, dist = parse_args(argv, usage)
    return health.run(opts, dist)
