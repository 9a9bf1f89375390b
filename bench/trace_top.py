"""Where a jaxtrain trace's device time goes: the ops that took longest, summed by name.

    python bench/trace_top.py runs/gpt2_124m/profile      # the folder --profile_steps wrote
    python bench/trace_top.py trace.json.gz --top 40 --match GPU

Reads the newest perfetto_trace.json.gz under the folder (jax.profiler writes one per trace).
Sums complete events ("X") per name on each track whose process name contains --match (device
tracks: "/device:GPU:0" on GPUs, "/host:CPU" on CPUs), and prints each one's total, count and
share of that track's busy time.
"""

import argparse
import collections
import gzip
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Prints each track's top ops; returns every op's total microseconds per track."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("path", type=Path)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--match", default="GPU", help="substring of the track's process name")
    args = parser.parse_args(argv)
    path = args.path
    if path.is_dir():
        path = max(path.rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    events = json.loads(gzip.decompress(path.read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {
        e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}  # fmt: skip
    per_track: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    spans: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") != "X" or args.match not in names.get(e.get("pid"), ""):
            continue
        track = f"{names[e['pid']]} / {threads.get((e['pid'], e.get('tid')), e.get('tid'))}"
        per_track[track][e["name"]] += e.get("dur", 0)
        counts[track][e["name"]] += 1
        lo, hi = spans.get(track, [e["ts"], e["ts"]])
        spans[track] = [min(lo, e["ts"]), max(hi, e["ts"] + e.get("dur", 0))]
    for track, totals in sorted(per_track.items(), key=lambda kv: -sum(kv[1].values())):
        busy = sum(totals.values())
        wall = spans[track][1] - spans[track][0]
        n = sum(counts[track].values())
        print(f"\n{track}: busy {busy / 1e3:.1f} ms of a {wall / 1e3:.1f} ms span, {n} events")
        for name, dur in totals.most_common(args.top):
            print(f"  {dur / 1e3:9.2f} ms {100 * dur / busy:5.1f}%  x{counts[track][name]:<5} {name[:110]}")
    return {track: dict(totals) for track, totals in per_track.items()}


if __name__ == "__main__":
    main()
