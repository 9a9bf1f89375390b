"""The deterministic global batch order over weighted sources, the per-process grain loaders.

    sources = open_sources("data/web/manifest.json", "train", vocab_size, "auto", seq_len)  # sources.py
    for batch in train_loader(sources, batch_size, seed, start_step, total_steps,
                              process_index, process_count, num_threads=4, prefetch=4):
        inputs, targets = batch[:, :-1], batch[:, 1:]

The global batch at step s depends only on (the sources' window counts and weights, batch_size,
seed, s): never on the process or device count, so a run can resume on a different topology and
see the same data. Global sample g = s * batch_size + r goes to a source by weight: source k takes
floor(G * c_k) - floor(G * c_(k-1)) of the first G samples (c the cumulative weights), so every
step's composition is exact to one row and any window of steps matches the weights to two rows.
A batch's rows are grouped by source. A source's j-th sample is window perm_e(j % n) of epoch
e = j // n of its n windows, perm_e a keyed Feistel permutation of [0, n): computed per index, so
it needs no memory, no cache and no lock however large the data, and grain's threads call it freely.
One source reads exactly as the single token file of earlier versions did.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grain
import numpy as np

from jaxtrain.config.batch import check_batch_split
from jaxtrain.data.sources import DataError, Source

_ROUNDS = 6  # Feistel rounds; 4 already give a pseudorandom permutation, 6 for margin
_MASK64 = 2**64 - 1
_WEIGHT_SCALE = 2**32  # weights become exact integer fractions of this


# ---------------------------------------------------------------- batch order


def process_rows(batch_size: int, process_index: int, process_count: int) -> slice:
    """The rows of each global batch that process `process_index` loads."""
    check_batch_split(batch_size, process_count)
    if not 0 <= process_index < process_count:
        raise DataError(f"process_index {process_index} is outside [0, {process_count})")
    local = batch_size // process_count
    return slice(process_index * local, (process_index + 1) * local)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a fast, well-mixing hash of uint64 values (wraps by design)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _feistel(x: np.ndarray, half_bits: int, keys: np.ndarray) -> np.ndarray:
    """A balanced Feistel network: a bijection of [0, 4**half_bits) for any round keys."""
    mask, shift = np.uint64((1 << half_bits) - 1), np.uint64(half_bits)
    left, right = x >> shift, x & mask
    for key in keys:
        left, right = right, left ^ (_mix(right ^ key) & mask)
    return (left << shift) | right


def _permute(idx: np.ndarray, n: int, seed: int, epoch: int, stream: int = 0) -> np.ndarray:
    """perm_(seed, epoch, stream)[idx] for a pseudorandom permutation of [0, n)."""
    # Stream 0 keeps the keys of single-file runs, so their batches are unchanged.
    entropy = [seed & _MASK64, epoch] + ([stream] if stream else [])
    keys = np.random.SeedSequence(entropy).generate_state(_ROUNDS, np.uint64)
    half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
    x = _feistel(idx.astype(np.uint64), half_bits, keys)
    # Cycle-walking: re-encrypt values past n; this restricts the bijection to [0, n), and
    # since the domain is < 4n it takes under 4 rounds on average.
    out = x >= n
    while out.any():
        x[out] = _feistel(x[out], half_bits, keys)
        out = x >= n
    return x.astype(np.int64)


def _cumulative_weights(weights: Sequence[float]) -> list[int]:
    """Cumulative weights as integers out of _WEIGHT_SCALE, the last exactly _WEIGHT_SCALE."""
    total, run, out = float(sum(weights)), 0.0, []
    for w in weights:
        run += w
        out.append(round(run / total * _WEIGHT_SCALE))
    out[-1] = _WEIGHT_SCALE
    return out


def _taken(cum: Sequence[int], samples: int) -> list[int]:
    """How many of the first `samples` global samples each source takes (exact integers)."""
    edges = [0] + [samples * c // _WEIGHT_SCALE for c in cum]
    return [b - a for a, b in zip(edges, edges[1:], strict=False)]


def global_batch_windows(
    sizes: Sequence[int],
    weights: Sequence[float],
    batch_size: int,
    seed: int,
    step: int,
    rows: slice | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(source, window) of rows `rows` (default all) of the global batch at `step`; sizes: windows."""
    cum = _cumulative_weights(weights)
    before = _taken(cum, step * batch_size)
    counts = [a - b for a, b in zip(_taken(cum, (step + 1) * batch_size), before, strict=True)]
    source = np.repeat(np.arange(len(sizes), dtype=np.int64), counts)
    first_row = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    sample = np.asarray(before, dtype=np.int64)[source] + np.arange(batch_size) - first_row[source]
    if rows is not None:
        source, sample = source[rows], sample[rows]
    window = np.empty_like(sample)
    for k in np.unique(source):
        n, here = sizes[k], source == k
        epoch, idx = sample[here] // n, sample[here] % n
        out = np.empty_like(idx)
        for e in np.unique(epoch):  # at most two epochs meet in one batch unless it outgrows the data
            at = epoch == e
            out[at] = _permute(idx[at], n, seed, int(e), stream=int(k) if len(sizes) > 1 else 0)
        window[here] = out
    return source, window


def epoch_windows(sources: Sequence[Source]) -> int:
    """Windows in one pass over every source (what an epoch means for --epochs)."""
    return sum(s.shards.n_windows for s in sources)


def read_batch(sources: Sequence[Source], source: np.ndarray, window: np.ndarray) -> np.ndarray:
    """The tokens of (source, window) pairs as int32 (n, seq_len + 1), in that order."""
    out = np.empty((len(window), sources[0].shards.seq_len + 1), dtype=np.int32)
    for k in np.unique(source):
        here = source == k
        out[here] = sources[k].shards.read(window[here])
    return out


def train_loader(
    sources: Sequence[Source],
    batch_size: int,
    seed: int,
    start_step: int,
    total_steps: int,
    process_index: int,
    process_count: int,
    num_threads: int,
    prefetch: int,
) -> Iterator[np.ndarray]:
    """This process's rows of the global batches of steps [start_step, total_steps), read ahead."""
    rows = process_rows(batch_size, process_index, process_count)
    if start_step < 0:
        raise DataError(f"start_step must be >= 0, got {start_step}")
    sizes = [s.shards.n_windows for s in sources]
    weights = [s.weight for s in sources]

    def batch_at(step: int) -> np.ndarray:
        return read_batch(sources, *global_batch_windows(sizes, weights, batch_size, seed, step, rows))

    # The position in the data is the global step alone, so resuming is a different start_step.
    ds = grain.MapDataset.range(start_step, max(start_step, total_steps)).map(batch_at)
    options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
    return iter(ds.to_iter_dataset(options))


def eval_batches(
    source: Source, batch_size: int, n_batches: int, process_index: int, process_count: int
) -> list[np.ndarray]:
    """A fixed set of validation batches (this process's rows), the same for every call and topology."""
    rows = process_rows(batch_size, process_index, process_count)
    n, total = source.shards.n_windows, n_batches * batch_size
    # Evenly spaced windows over all shards; data with fewer windows repeats some.
    windows = np.arange(total, dtype=np.int64) * n // total
    return [
        source.shards.read(windows[b * batch_size : (b + 1) * batch_size][rows]) for b in range(n_batches)
    ]
