"""jaxtrain's loop against a bare jax+optax loop: same model, same devices, one run.

    python bench/bench_loop.py                       # configs/default.yaml model, all local devices
    python bench/bench_loop.py --config configs/gpt2_124m.yaml --steps 40 --dtype bfloat16   # on a GPU
    python bench/bench_loop.py --scan_layers true    # any train.py flag is passed through
    python bench/bench_loop.py --config configs/tiny.yaml --steps 2 --warmup 1 --rounds 1   # smoke

The two are run alternately (`--rounds`, median taken) so machine noise hits both alike.
Prints tokens/s of each, their ratio, and the share of jaxtrain's step time spent waiting
for data.
"""

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxtrain.cluster.detect import detect
from jaxtrain.config import Config, load_config
from jaxtrain.model.transformer import GPT
from jaxtrain.run.job import Job
from jaxtrain.run.loop import train

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def bare_loop(cfg: Config, steps: int, warmup: int) -> float:
    """The least a training loop can do: jit(grad + optax update) on pre-made batches. Tokens/s."""
    model = GPT(cfg.model, dtype=_DTYPES[cfg.dtype])
    mesh = jax.make_mesh((jax.device_count(),), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.optim.lr, cfg.optim.warmup_steps, cfg.total_steps)
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.gradient_clip_val),
        optax.adamw(schedule, b1=cfg.optim.b1, b2=cfg.optim.b2, weight_decay=cfg.optim.weight_decay),
    )
    params = jax.device_put(
        model.init(jax.random.key(0), jnp.zeros((1, cfg.model.seq_len), jnp.int32))["params"], whole
    )
    opt_state = tx.init(params)

    def loss_fn(p, batch):
        logits = model.apply({"params": p}, batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    @jax.jit
    def step(p, o, batch):
        loss, g = jax.value_and_grad(loss_fn)(p, batch)
        updates, o = tx.update(g, o, p)
        return optax.apply_updates(p, updates), o, loss

    rng = np.random.default_rng(0)
    shape = (cfg.batch_size, cfg.model.seq_len + 1)
    batches = [
        jax.device_put(rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32), rows) for _ in range(4)
    ]
    for i in range(warmup):
        params, opt_state, loss = step(params, opt_state, batches[i % 4])
    loss.block_until_ready()
    t0 = time.perf_counter()
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, batches[i % 4])
    loss.block_until_ready()
    return steps * cfg.batch_size * cfg.model.seq_len / (time.perf_counter() - t0)


def jaxtrain_loop(cfg: Config, steps: int, warmup: int, run_dir: Path) -> tuple[float, float]:
    """jaxtrain's own train() (as scripts/train.py runs it, one process); tokens/s and data-wait
    share from its metrics, after warmup. `cfg`: resolved on the devices (Job.of_devices)."""
    import dataclasses

    cfg = dataclasses.replace(
        cfg, run_dir=str(run_dir), overwrite=True, total_steps=warmup + steps, log_interval=warmup,
        eval_interval=0, checkpoint_interval=10**9, sample_tokens=0, progress_bar=False,
    )  # fmt: skip
    if steps % warmup:
        raise SystemExit("--steps must be a multiple of --warmup")
    log = logging.getLogger("jaxtrain")
    log.disabled = True  # keep the benchmark's output to its figures
    try:
        train(cfg, detect(cfg.dist))
    finally:
        log.disabled = False  # a caller in the same process (tests/test_bench.py) logs again
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "loss" in r and r["step"] > warmup]
    total_time = sum(r["step_time_s"] * warmup for r in timed)
    wait = sum(r["data_wait_frac"] * r["step_time_s"] * warmup for r in timed)
    return len(timed) * warmup * cfg.batch_size * cfg.model.seq_len / total_time, wait / total_time


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    """Prints the figures; returns each round's tokens/s and data wait."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args, rest = parser.parse_known_args(argv)
    if not any(a.startswith("--config") for a in rest):
        rest = ["--config", "configs/default.yaml", *rest]
    cfg = Job.of_devices(load_config(rest), jax.devices()).cfg  # as training resolves it here
    print(f"model {cfg.model.n_layer}x{cfg.model.d_model}, batch {cfg.batch_size}x{cfg.model.seq_len}, "
          f"{cfg.dtype}, {jax.device_count()} x {jax.devices()[0].device_kind}", file=sys.stderr)  # fmt: skip
    bare, ours, waits = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            bare.append(bare_loop(cfg, args.steps, args.warmup))
            tps, wait = jaxtrain_loop(cfg, args.steps, args.warmup, Path(tmp) / f"r{r}")
            ours.append(tps)
            waits.append(wait)
            print(f"round {r}: bare {bare[-1]:,.0f} tok/s, jaxtrain {ours[-1]:,.0f} tok/s", file=sys.stderr)
    ratios = [x / y for x, y in zip(ours, bare, strict=True)]
    print(f"bare jax+optax loop : {statistics.median(bare):,.0f} tokens/s median, {max(bare):,.0f} best")
    print(f"jaxtrain loop       : {statistics.median(ours):,.0f} tokens/s median, {max(ours):,.0f} best")
    best = max(ours) / max(bare)
    print(f"ratio jaxtrain/bare : {statistics.median(ratios):.3f} median of rounds, {best:.3f} best/best")
    print(f"                      per round: {', '.join(f'{r:.3f}' for r in ratios)}")
    print(f"data wait           : {100 * statistics.median(waits):.2f}% of jaxtrain step time")
    return {"bare": bare, "jaxtrain": ours, "data_wait": waits}


if __name__ == "__main__":
    main()
