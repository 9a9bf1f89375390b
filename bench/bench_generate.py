"""Tokens/s of KV-cached `model.generate` against re-running the whole window per token (what
generate did before the cache), 256 new tokens, both in this one process, alternating rounds.

    .venv/bin/python bench/bench_generate.py            # ~2 min on a 2-core CPU
    .venv/bin/python bench/bench_generate.py --json bench/results/generate_cpu.json
    .venv/bin/python bench/bench_generate.py --shapes default --new_tokens 16 --rounds 1     # smoke

Shapes: the default model (configs/default.yaml, seq_len 128: 256 tokens refill the cache
twice) and a longer window (seq_len 512), random params (speed does not depend on training):
a fresh state of the run training would build, on one device.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.config import ModelConfig, load_config
from jaxtrain.model.generate import generate
from jaxtrain.model.transformer import GPT
from jaxtrain.run.build import build
from jaxtrain.run.job import Job

NEW_TOKENS = 256
_MODEL = ["--model.vocab_size", "256", "--model.n_layer", "4", "--model.n_head", "4"]
SHAPES = {  # --shapes name -> (name in the figures, train.py flags)
    "default": ("default (d128 L4 T128)", [*_MODEL, "--model.seq_len", "128", "--model.d_model", "128"]),
    "long": ("long window (d256 L4 T512)", [*_MODEL, "--model.seq_len", "512", "--model.d_model", "256"]),
}


@functools.partial(jax.jit, static_argnames=("cfg",))
def _uncached_next(params: Any, window: jax.Array, pos: jax.Array, cfg: ModelConfig) -> jax.Array:
    logits = GPT(cfg).apply({"params": params}, window)[0, pos]  # type: ignore[index]
    return jnp.argmax(logits).astype(jnp.int32)


def uncached_generate(params: Any, cfg: ModelConfig, prompt: np.ndarray, n: int) -> np.ndarray:
    """The previous generate: the last seq_len tokens, right-padded, through the whole model per token."""
    tokens = [int(t) for t in prompt]
    for _ in range(n):
        context = tokens[-cfg.seq_len :]
        window = np.zeros((1, cfg.seq_len), np.int32)
        window[0, : len(context)] = context
        tokens.append(int(_uncached_next(params, window, np.int32(len(context) - 1), cfg=cfg)))
    return np.asarray(tokens[len(prompt) :], np.int32)


def _tokens_per_s(fn: Any) -> float:
    t0 = time.perf_counter()
    out = fn()
    return len(out) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Prints the figures; returns them per shape."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma list of: " + ", ".join(SHAPES))
    parser.add_argument("--new_tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    n_new = args.new_tokens
    prompt = np.frombuffer(b"def main():", np.uint8).astype(np.int32)
    results = {}
    for name, flags in (SHAPES[s] for s in args.shapes.split(",")):
        run = build(Job.of_devices(load_config(flags), jax.devices()[:1]))
        cfg, params = run.cfg.model, run.init_state().params
        rng = jax.random.key(1)
        cached = lambda: generate(params, cfg, prompt, n_new, rng, top_k=1)  # noqa: B023, E731
        uncached = lambda: uncached_generate(params, cfg, prompt, n_new)  # noqa: B023, E731
        cached(), uncached()  # compile both
        speeds: dict[str, list[float]] = {"cached": [], "uncached": []}
        for _ in range(args.rounds):
            speeds["cached"].append(_tokens_per_s(cached))
            speeds["uncached"].append(_tokens_per_s(uncached))
        median = {k: statistics.median(v) for k, v in speeds.items()}
        results[name] = {**{f"{k}_tokens_per_s": round(v, 1) for k, v in median.items()},
                         "speedup": round(median["cached"] / median["uncached"], 2)}  # fmt: skip
        print(
            f"{name}: cached {median['cached']:,.0f} tokens/s, uncached {median['uncached']:,.0f} tokens/s, "
            f"x{median['cached'] / median['uncached']:.2f} ({n_new} new tokens, median of {args.rounds})"
        )
    if args.json:
        meta = {"device": jax.devices()[0].device_kind, "cpus": platform.processor() or platform.machine()}
        with open(args.json, "w") as f:
            json.dump({"new_tokens": n_new, **meta, "results": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
