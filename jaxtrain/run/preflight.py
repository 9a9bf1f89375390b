"""Preflight: each GPU-only kernel a job chose, run on a small problem, forward and backward, against
the path already proven on CPU, before the job compiles its step.

    verdicts = preflight(Choices(attention="cudnn", grouped_matmul="pallas", exchange="ragged",
                                 d_model=2048, expert_dim=768), job.devices)
    [v for v in verdicts if not v.passed]        # each says what failed in one line

The GPU-only paths are cuDNN's fused attention (model/attention.py), the Pallas Mosaic-GPU grouped
matmul with its dX and dW kernels (model/grouped_kernels.py) and XLA's ragged all-to-all; on CPU
their references stand in for them (XLA's attention, `jax.lax.ragged_dot`, the padded all-to-all
that stands in for the ragged one on XLA:CPU), so the same checks run in CI. A check compares the
kernel in the job's dtype with its reference in float32 on the same (rounded) inputs, by the
relative norm of the difference, and plants what a kernel must ignore: NaN in the rows past the
routed ones (in the rows and in the gradient), an empty expert, a slice that sends nothing, a
document boundary. NaN never passes.
Pure: nothing printed, no device asked for; the caller hands in the devices.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain import xla_env
from jaxtrain.model import grouped
from jaxtrain.observe import gemms

# The kernels and references checked, by module attribute in this one place: model/ and parallel/
# are refactored often, and a rename is then a one-line fix here (meanwhile only the checks using it
# fail, saying so). Each entry lists the places to look, in order ("module:attribute").
KERNELS = {
    # (q, k, v, impl, segments) -> causal attention by impl: cudnn or xla
    "attention": ("jaxtrain.model.attention:causal_attention",),
    # (rows, w, sizes, routed, interpret): the Pallas kernels' custom_vjp
    "ragged_matmul": ("jaxtrain.model.grouped_kernels:ragged_matmul",),
    # the same on FP8 tiles (model.matmul fp8); its reference rounds by numpy (`numpy_quantized`)
    "ragged_matmul_fp8": ("jaxtrain.model.grouped_fp8:ragged_matmul_fp8",),
    # (rows, sizes, w_in, w_out, impl): the experts' MLPs by pallas, ragged_dot or blocks
    "expert_mlps": ("jaxtrain.model.moe:expert_mlps",),
    # ragged_all_to_all's arguments + width: XLA:CPU's stand-in for it
    "padded_exchange": ("jaxtrain.parallel.expert:padded_ragged_all_to_all",),
    # (lhs, rhs, dimension_numbers) -> the FP8 projection's dot_general
    "fp8_matmul": ("jaxtrain.model.fp8:fp8_dot_general",),
}
# Relative-norm error allowed against the float32 reference. bfloat16 rounds each output to 2^-9,
# about 4e-3 as a norm; the attention gradients pass through bfloat16 probabilities too.
TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4}
EXPERT_SIZES = (300, 0, 137, 291)  # rows per expert: tiles straddle experts; one empty
BUFFER_ROWS = 1024  # the grouped matmul's buffer: 296 rows past the routed 728 hold NaN

Compared = dict[str, tuple[jax.Array, jax.Array]]  # output -> (the kernel's, the reference's)


def kernel(name: str) -> Callable[..., Any]:
    """The function KERNELS names (Pallas's modules are imported only when their kernel is asked for)."""
    for place in KERNELS[name]:
        module, _, attr = place.partition(":")
        try:
            found = getattr(importlib.import_module(module), attr, None)
        except ModuleNotFoundError:
            found = None
        if found is not None:
            return found
    raise LookupError(
        f"{' or '.join(KERNELS[name])} is gone (renamed?): update jaxtrain/run/preflight.py KERNELS"
    )


@dataclass(frozen=True)
class Choices:
    """A job's resolved kernels ("" = not used) and the widths it runs them at."""

    attention: str = ""  # cudnn | xla
    grouped_matmul: str = ""  # pallas | pallas_fp8 | ragged_dot | blocks
    exchange: str = ""  # ragged | padded
    dtype: str = "bfloat16"
    heads: tuple[int, int, int, int] = (12, 12, 64, 64)  # query heads, key/value heads, head dim, value dim
    documents: bool = False
    d_model: int = 0
    expert_dim: int = 0  # per tensor shard
    length: int = 512  # tokens of the attention check
    matmul: str = ""  # fp8 projections: cublaslt (GPU) | xla (CPU)
    d_ff: int = 0  # the MLP's width per tensor shard (the FP8 check's GEMM)


@dataclass(frozen=True)
class Check:
    """One kernel on one problem: `compute(devices)` gives each output's (kernel, reference)."""

    name: str
    compute: Callable[[Sequence[Any]], Compared]
    tolerance: float
    informational: bool = False  # recorded, not judged (a kernel run outside what it supports)


@dataclass(frozen=True)
class Verdict:
    name: str
    passed: bool
    errors: dict[str, float]  # output -> relative-norm error against the reference
    failed: str  # what failed, one line; "" if it passed
    detail: str  # the error's text, for a log
    seconds: float
    informational: bool = False

    @property
    def max_error(self) -> float | None:
        return max(self.errors.values()) if self.errors else None

    def line(self) -> str:
        """'pass  name  max error 3.1e-03  (1.2 s)', or FAIL and what failed."""
        state = "pass" if self.passed else ("fail (informational)" if self.informational else "FAIL")
        err = f"max error {self.max_error:.1e}" if self.max_error is not None else "no error measured"
        why = f": {self.failed}" if self.failed else ""
        return f"{state:<5} {self.name}  {err}  ({self.seconds:.1f} s){why}"


def run_check(check: Check, devices: Sequence[Any]) -> Verdict:
    """Run one check; any exception (a refused or failed compile, a kernel's error) is its failure."""
    t0 = time.perf_counter()
    errors: dict[str, float] = {}
    failed: list[str] = []
    detail = ""
    try:
        for what, (got, want) in check.compute(devices).items():
            got, want = got.astype(jnp.float32), want.astype(jnp.float32)
            if not bool(jnp.isfinite(got).all()):
                failed.append(f"{what} holds NaN or inf")
                continue
            scale = float(jnp.linalg.norm(want))
            errors[what] = float(jnp.linalg.norm(got - want)) / (scale if scale > 0 else 1.0)
            if not errors[what] <= check.tolerance:
                failed.append(f"{what} off by {errors[what]:.1e} (tolerance {check.tolerance:.0e})")
    except Exception as e:  # noqa: BLE001  a kernel that does not run is the verdict, not a crash
        detail = f"{type(e).__name__}: {e}"[-4000:]
        failed.append(_first_line(e))
    return Verdict(
        check.name,
        not failed,
        errors,
        "; ".join(failed),
        detail,
        time.perf_counter() - t0,
        check.informational,
    )


def _first_line(e: BaseException) -> str:
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def preflight(choices: Choices, devices: Sequence[Any]) -> list[Verdict]:
    """Every check of `choices` on `devices` (the job's, or one of them: each check uses the first,
    the exchange all of them)."""
    capability = str(getattr(devices[0], "compute_capability", ""))
    return [run_check(c, devices) for c in checks(choices, devices[0].platform, capability)]


def on_each(found: Sequence[Check], devices: Sequence[Any]) -> list[Verdict]:
    """Each one-device check on each of `devices` alone (a bad GPU fails only its own), the exchange
    once over all of them; a failure's line names its device. A CPU's devices are one processor:
    its first stands for them. The checks run in threads, one a device, so their compiles overlap."""
    alone = list(devices) if devices[0].platform != "cpu" else list(devices[:1])
    runs = [(c, [d]) for c in found if not c.name.startswith("exchange") for d in alone]
    runs += [(c, list(devices)) for c in found if c.name.startswith("exchange")]
    with ThreadPoolExecutor(max_workers=len(alone)) as pool:
        verdicts = list(pool.map(lambda run: run_check(*run), runs))
    return [
        dataclasses.replace(v, failed=f"{on[0]}: {v.failed}") if v.failed and len(on) == 1 else v
        for v, (_, on) in zip(verdicts, runs, strict=True)
    ]


def checks(choices: Choices, platform: str, capability: str) -> list[Check]:
    """The checks of a job's choices on devices of `platform` ("gpu", "cpu") and compute capability."""
    found: list[Check] = []
    n, kv, h, hv = choices.heads
    if choices.attention:
        attention = attention_check(
            choices.attention, n, kv, h, hv, choices.documents, choices.dtype, length=choices.length
        )
        found.append(attention)
    if choices.grouped_matmul:
        d, ff = choices.d_model, choices.expert_dim
        pallas = choices.grouped_matmul in ("pallas", "pallas_fp8")
        why = grouped.refusal(platform, capability, d, ff) if pallas else None
        if why:
            found.append(refused(f"grouped_matmul {choices.grouped_matmul} d{d} ff{ff}", why))
        elif choices.grouped_matmul == "pallas_fp8":  # against the same roundings in float32
            found.append(grouped_check(d, ff, choices.dtype, fp8=True))
        else:
            found.append(expert_check(choices.grouped_matmul, d, ff, choices.dtype, **_small(platform)))
            if choices.grouped_matmul == "pallas":
                found.append(grouped_check(d, ff, choices.dtype))
    if choices.exchange:
        rows, d = (128, 64) if platform == "cpu" else (512, 256)  # as _small: the path, less compile
        found.append(exchange_check(choices.exchange, d=d, rows=rows))
    if choices.matmul:
        found.append(fp8_check(choices.length, choices.d_model, choices.d_ff or choices.d_model))
    return found


def _small(platform: str) -> dict[str, Any]:
    """A CPU's problem: its kernels are the references, with no GPU tiles to straddle, so a smaller
    buffer proves the same path (an empty expert, BLOCK-row blocks straddled, NaN past the routed
    rows) at a third of the compile time."""
    return {"sizes": (150, 0, 37, 61), "buffer": 320} if platform == "cpu" else {}


def refused(name: str, why: str) -> Check:
    """A check that fails with the refusal's line: the kernel cannot run here."""

    def compute(devices: Sequence[Any]) -> Compared:
        raise ValueError(f"refused: {why}")

    return Check(name, compute, 0.0)


# --------------------------------------------------------------------------------- problems


def _normal(key: jax.Array, shape: tuple[int, ...], dtype: Any, scale: float = 1.0) -> jax.Array:
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def _reference(fn: Callable[..., Any], *args: Any) -> Any:
    """fn traced in float32 at full precision (a GPU would otherwise multiply float32 in TF32)."""
    with jax.default_matmul_precision("highest"):
        return jax.jit(fn)(*(jax.tree.map(lambda a: a.astype(jnp.float32), args)))


def _with_grads(fn: Callable[..., jax.Array], args: tuple[jax.Array, ...], cot: jax.Array) -> tuple[Any, ...]:
    """fn(*args) and its gradient with respect to every arg, for the output cotangent `cot`."""
    out, vjp = jax.vjp(fn, *args)
    return out, *vjp(cot.astype(out.dtype))


def _routed_rows(m: int, routed: int, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    """Each array with its rows past `routed` set to NaN (what a kernel must never read or write into
    a routed row), and the same with zeros (what the reference gets)."""
    past = (jnp.arange(m) >= routed)[:, None]
    return tuple(jnp.where(past, jnp.nan, a).astype(a.dtype) for a in arrays) + tuple(
        jnp.where(past, 0, a).astype(a.dtype) for a in arrays
    )


def grouped_check(
    d: int, ff: int, dtype: str, *, interpret: bool = False, backward: bool = True,
    sizes: tuple[int, ...] = EXPERT_SIZES, buffer: int = BUFFER_ROWS, fp8: bool = False,
) -> Check:  # fmt: skip
    """The Pallas grouped matmul alone, rows [m, d] x w [E, d, ff]: its forward, dX and dW kernels
    against `jax.lax.ragged_dot`'s. `interpret`: Pallas's GPU interpreter (on CPU), which runs the
    forward only (it has no transposed shared-memory operands). `sizes`: each expert's rows, in a
    buffer of `buffer` rows (the rest NaN). `fp8`: its FP8 kernels (model/grouped_fp8.py) against
    ragged_dot on the same roundings (`fp8_rounded`), in float32."""

    def compute(devices: Sequence[Any]) -> Compared:
        matmul = kernel("ragged_matmul_fp8" if fp8 else "ragged_matmul")
        routed, m, e = sum(sizes), buffer, len(sizes)
        group_sizes = jnp.array(sizes, jnp.int32)
        with jax.default_device(devices[0]):
            k = jax.random.split(jax.random.key(0), 3)
            rows, w = _normal(k[0], (m, d), dtype), _normal(k[1], (e, d, ff), dtype, 1 / math.sqrt(d))
            cot = _normal(k[2], (m, ff), dtype)
            rows_nan, cot_nan, rows0, cot0 = _routed_rows(m, routed, rows, cot)

            def ours(r: jax.Array, w: jax.Array) -> jax.Array:
                return matmul(r, w, group_sizes, m, interpret)

            def ref(r: jax.Array, w: jax.Array) -> jax.Array:
                return jax.lax.ragged_dot(r, w, group_sizes)

            if not backward:
                out, want = jax.jit(ours)(rows_nan, w), _reference(ref, rows0, w)
                return {"out": (out[:routed], want[:routed])}
            got = jax.jit(lambda r, w, c: _with_grads(ours, (r, w), c))(rows_nan, w, cot_nan)
            if fp8:
                want = fp8_rounded_grads(rows0, w, cot0, group_sizes)
            else:
                want = _reference(lambda r, w, c: _with_grads(ref, (r, w), c), rows0, w, cot0)
        return {
            "out": (got[0][:routed], want[0][:routed]),
            "d_rows": (got[1][:routed], want[1][:routed]),
            "d_w": (got[2], want[2]),  # the empty expert's too: zero, never NaN
        }

    impl = "pallas_fp8" if fp8 else "pallas"
    name = f"ragged_matmul {impl} d{d} ff{ff} {dtype}{' interpreted' if interpret else ''}"
    return Check(name + ("" if backward else " forward"), compute, TOLERANCE[dtype], dtype == "float32")


def fp8_rounded_grads(rows: jax.Array, w: jax.Array, cot: jax.Array, sizes: jax.Array) -> tuple[Any, ...]:
    """model/grouped_fp8.py's output and gradients (rows, w), multiplied by `jax.lax.ragged_dot` in
    float32 on the same roundings, made by numpy (`numpy_quantized`, not model/fp8.py's): forward,
    the routed rows e4m3 by their scale and each expert's weights by its own; backward, the
    gradient's routed rows e5m2 against those e4m3 operands rounded again to e5m2 (Mosaic's wgmma
    takes one FP8 type a GEMM)."""
    routed = (np.arange(rows.shape[0]) < int(np.sum(sizes)))[:, None]
    rows_, w_, cot_ = (np.asarray(jax.device_get(a), np.float32) for a in (rows, w, cot))
    x4, sx = numpy_quantized(np.where(routed, rows_, 0), ml_dtypes.float8_e4m3fn)
    g5, sg = numpy_quantized(np.where(routed, cot_, 0), ml_dtypes.float8_e5m2)
    each = [numpy_quantized(we, ml_dtypes.float8_e4m3fn) for we in w_]
    w4, sw = np.stack([q for q, _ in each]), np.array([s for _, s in each], np.float32)[:, None, None]
    x5, w5 = (a.astype(ml_dtypes.float8_e5m2).astype(np.float32) for a in (x4, w4))

    def products(x: jax.Array, w: jax.Array, x5: jax.Array, w5: jax.Array, g: jax.Array) -> tuple[Any, ...]:
        _, vjp = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes), x5, w5)
        return (jax.lax.ragged_dot(x, w, sizes), *vjp(g))

    return _reference(products, x4 * sx, w4 * sw, x5 * sx, w5 * sw, g5 * sg)


def expert_check(
    impl: str,
    d: int,
    ff: int,
    dtype: str,
    *,
    sizes: tuple[int, ...] = EXPERT_SIZES,
    buffer: int = BUFFER_ROWS,
) -> Check:
    """The experts' SwiGLU MLPs (moe.expert_mlps: two grouped matmuls) by `impl` against ragged_dot
    in float32: outputs and gradients of rows, w_in and w_out, with NaN in the rows past the routed
    ones (the exchange's recycled buffers hold any bits there) and in their gradient."""

    def compute(devices: Sequence[Any]) -> Compared:
        mlps = kernel("expert_mlps")
        routed, m, e = sum(sizes), buffer, len(sizes)
        group_sizes = jnp.array(sizes, jnp.int32)
        with jax.default_device(devices[0]):
            k = jax.random.split(jax.random.key(1), 4)
            rows = _normal(k[0], (m, d), dtype)
            w_in = _normal(k[1], (e, d, 2, ff), dtype, 1 / math.sqrt(d))
            w_out = _normal(k[2], (e, ff, d), dtype, 1 / math.sqrt(ff))
            rows_nan, cot_nan, rows0, cot0 = _routed_rows(m, routed, rows, _normal(k[3], (m, d), dtype))

            def run(impl: str) -> Callable[..., tuple[Any, ...]]:
                return lambda r, a, b, c: _with_grads(
                    lambda *x: mlps(x[0], group_sizes, x[1], x[2], impl), (r, a, b), c
                )

            got = jax.jit(run(impl))(rows_nan, w_in, w_out, cot_nan)
            want = _reference(run("ragged_dot"), rows0, w_in, w_out, cot0)
        return {
            "out": (got[0][:routed], want[0][:routed]),
            "d_rows": (got[1][:routed], want[1][:routed]),
            "d_w_in": (got[2], want[2]),
            "d_w_out": (got[3], want[3]),
        }

    # Pallas's tiles in float32 may not fit shared memory (grouped_check): recorded, not judged.
    beyond = impl == "pallas" and dtype == "float32"
    return Check(f"expert_mlps {impl} d{d} ff{ff} {dtype}", compute, TOLERANCE[dtype], beyond)


def attention_check(
    impl: str, n: int, kv: int, h: int, hv: int, documents: bool, dtype: str, *, length: int = 512,
    batch: int = 2, reference: str = "xla",
) -> Check:  # fmt: skip
    """Causal attention by `impl` (model/attention.py's kernels) against `reference` (XLA's) in
    float32: output and gradients of q, k, v. n query heads of h, kv key/value heads, values hv wide
    (DeepSeek's 192 and 128: cuDNN gets the values padded); `documents`: the first row holds three
    documents; the others also hold many short ones (one-token documents, documents inside one
    32-token block and across blocks), so every level of cuDNN's packed form is taken
    (model/documents.py `levels`: whole window, then blocks of 32)."""

    def compute(devices: Sequence[Any]) -> Compared:
        attend = kernel("attention")
        segments = None
        if documents:
            t = np.arange(length)
            short = [5, 6, 7, 40, 41, 100, 101, 102, 103, 250, 300, 301, length - 52]
            starts = [
                [length // 3 + 7 * b, 2 * length // 3 + 11 * b, *(short if b else [])] for b in range(batch)
            ]
            segments = jnp.array(
                np.stack([(t[:, None] >= np.array(s)[None]).sum(1) for s in starts]), jnp.int32
            )
        with jax.default_device(devices[0]):
            k = jax.random.split(jax.random.key(2), 4)
            q = _normal(k[0], (batch, length, n, h), dtype)
            key, v = (
                _normal(k[1], (batch, length, kv, h), dtype),
                _normal(k[2], (batch, length, kv, hv), dtype),
            )
            cot = _normal(k[3], (batch, length, n, hv), dtype)

            def run(impl: str) -> Callable[..., tuple[Any, ...]]:
                return lambda q, k, v, c: _with_grads(lambda *x: attend(*x, impl, segments), (q, k, v), c)

            got = jax.jit(run(impl))(q, key, v, cot)
            want = _reference(run(reference), q, key, v, cot)
        return dict(zip(("out", "d_q", "d_k", "d_v"), zip(got, want, strict=True), strict=True))

    name = f"attention {impl} {n}x{h} kv{kv}{f' v{hv}' if hv != h else ''} T{length}"
    return Check(f"{name}{' documents' if documents else ''} {dtype}", compute, TOLERANCE[dtype])


def _exchange_layout(
    rng: np.random.Generator, p: int, slices: int, rows: int
) -> tuple[np.ndarray, list[np.ndarray], int, int]:
    """Random slice sizes [source, destination, slice] over `p` devices (slice 1 always empty), the
    ragged_all_to_all index arrays they give (input offsets, send sizes, output offsets, receive
    sizes: [p, p * slices] each), the landing buffer's rows (with 64 past the landed ones, which
    must be left alone) and the padded stand-in's width."""
    sizes = rng.integers(1, rows // (p * slices), (p, p, slices))
    sizes[:, :, 1 % slices] = 0
    exclusive = lambda a: np.cumsum(a) - a  # noqa: E731
    in_offsets = np.stack([exclusive(sizes[s].reshape(-1)).reshape(p, slices) for s in range(p)])
    # Each destination's buffer grouped by slice, sources in order inside each (moe's layout).
    out_offsets = np.stack([exclusive(sizes[:, t].T.reshape(-1)).reshape(slices, p).T for t in range(p)], 1)
    index = [
        in_offsets.reshape(p, -1), sizes.reshape(p, -1), out_offsets.reshape(p, -1),
        sizes.transpose(1, 0, 2).reshape(p, -1),
    ]  # fmt: skip
    return sizes, index, int(sizes.sum(axis=(0, 2)).max()) + 64, int(sizes.sum(axis=2).max())


def exchange_check(
    impl: str, slices: int = 3, d: int = 256, rows: int = 512, seed: int = 3, buffer: bool = False
) -> Check:
    """The experts' token exchange over every device given, `slices` slices to each peer (one per
    expert of the peer's, one of them empty), by `impl` (ragged: XLA's ragged_all_to_all; padded:
    model/moe.py's stand-in, the reference): the rows that land, the buffer rows nothing lands in
    left as they were, and the gradient of the rows sent. Rows no slice sends hold NaN: they must go
    nowhere. bfloat16 copies: exact. `buffer`: the gradient of the landing buffer instead,
    informational: jaxtrain never takes it (its buffers are zeros or stopped: parallel/expert.py),
    and jax's transpose (0.10.2, 0.11.2: lax/parallel.py `_ragged_all_to_all_transpose`) masks the
    landed rows by +1 at each slice's offset and -1 at its end, set and added at the same index
    where an empty slice sits at the next one's start: it lets a landed slice's cotangent through
    (an H200 read 0.70 of the reference, 2026-11-28)."""

    def compute(devices: Sequence[Any]) -> Compared:
        padded = kernel("padded_exchange")
        p = len(devices)
        rng = np.random.default_rng(seed)
        sizes, index, bound, width = _exchange_layout(rng, p, slices, rows)
        sent = sizes.sum(axis=(1, 2))
        operand = rng.standard_normal((p, rows, d)).astype(np.float32)
        unsent = np.broadcast_to((np.arange(rows)[None, :] >= sent[:, None])[..., None], operand.shape)
        mesh = jax.sharding.Mesh(np.array(devices), ("x",))
        place = lambda a: jax.device_put(a, NamedSharding(mesh, P("x")))  # noqa: E731
        args = [
            # NaN set on the devices: across processes device_put compares its inputs, and NaN != NaN
            jax.jit(lambda x, u: jnp.where(u, jnp.nan, x))(
                place(operand.reshape(p * rows, d).astype(jnp.bfloat16)), place(unsent.reshape(p * rows, d))
            ),
            place(np.full((p * bound, d), 0.5, jnp.bfloat16)),
            *(place(a.astype(np.int32)) for a in index),
        ]
        cot = place(rng.standard_normal((p * bound, d)).astype(jnp.bfloat16))

        def local(impl: str) -> Callable[..., jax.Array]:
            def one(x: jax.Array, buffer: jax.Array, *index: jax.Array) -> jax.Array:
                flat = [i.reshape(-1) for i in index]
                if impl == "ragged":
                    return jax.lax.ragged_all_to_all(x, buffer, *flat, axis_name="x")
                return padded(x, buffer, *flat, axis_name="x", width=width)

            return jax.shard_map(one, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)

        def run(impl: str) -> Callable[..., tuple[Any, ...]]:
            return lambda x, b, c, *i: _with_grads(lambda x, b: local(impl)(x, b, *i), (x, b), c)

        got = jax.jit(run(impl))(args[0], args[1], cot, *args[2:])
        want = jax.jit(run("padded"))(jnp.nan_to_num(args[0]), args[1], cot, *args[2:])
        compared = dict(zip(("out", "d_rows", "d_buffer"), zip(got, want, strict=True), strict=True))
        return {"d_buffer": compared["d_buffer"]} if buffer else {k: compared[k] for k in ("out", "d_rows")}

    name = f"exchange {impl} {slices} slices a peer" + (": the landing buffer's gradient" if buffer else "")
    return Check(name, compute, 0.0, informational=buffer)


def fp8_check(m: int, k: int, n: int, *, scale: float = 1e-4) -> Check:
    """The FP8 projection (model/fp8.py: e4m3 operands, e5m2 gradient, each tensor scaled) on rows
    [m, k] x w [k, n], its output and both gradients, against the same roundings made by numpy
    (`numpy_rounded`: not model/fp8.py's, so a rounding or scale wrong there differs here) and
    multiplied in float32: a scale applied twice or not at all, an operand read in the wrong layout
    or products accumulated short is what it finds. Compiled as a job's FP8 step is
    (xla_env.FP8_OPTIONS); on a GPU all three GEMMs must come out as FP8 GEMMs (observe/gemms.py,
    the check a job's step passes where it starts), or the projections would multiply in bf16, at
    bf16's speed. The gradient is `scale` small, as a step's are: its own scale must bring it into
    e5m2's range."""

    def compute(devices: Sequence[Any]) -> Compared:
        matmul = kernel("fp8_matmul")
        dims = (((1,), (0,)), ((), ()))
        gpu = devices[0].platform != "cpu"
        with jax.default_device(devices[0]):
            r = jax.random.split(jax.random.key(4), 3)
            x, w = _normal(r[0], (m, k), "bfloat16"), _normal(r[1], (k, n), "bfloat16", 1 / math.sqrt(k))
            cot = _normal(r[2], (m, n), "bfloat16", scale)
            ours = jax.jit(lambda x, w, c: _with_grads(lambda x, w: matmul(x, w, dims), (x, w), c))
            compiled = ours.lower(x, w, cot).compile(xla_env.FP8_OPTIONS if gpu else None)
            fp8 = gemms.counts(gemms.census(compiled.as_text() or ""))["fp8"]
            if gpu and fp8 < 3:
                raise ValueError(f"{fp8} of 3 GEMMs compiled to FP8 GEMMs: the rest run in bf16")
            got = compiled(x, w, cot)
            xq, wq = numpy_rounded(x, ml_dtypes.float8_e4m3fn), numpy_rounded(w, ml_dtypes.float8_e4m3fn)
            gq = numpy_rounded(cot, ml_dtypes.float8_e5m2)
            want = _reference(lambda x, w, g: (x @ w, g @ w.T, x.T @ g), xq, wq, gq)
        return dict(zip(("out", "d_x", "d_w"), zip(got, want, strict=True), strict=True))

    return Check(f"fp8_matmul m{m} k{k} n{n}", compute, TOLERANCE["bfloat16"])


def numpy_rounded(x: jax.Array | np.ndarray, dtype: Any) -> np.ndarray:
    """x rounded to FP8 `dtype` by numpy alone (`numpy_quantized`) and scaled back, float32."""
    q, scale = numpy_quantized(x, dtype)
    return q * scale


def numpy_quantized(x: jax.Array | np.ndarray, dtype: Any) -> tuple[np.ndarray, np.float32]:
    """x divided by its scale and rounded to FP8 `dtype` (ml_dtypes' e4m3 or e5m2, round to nearest
    even) by numpy alone, as float32, and the scale: as model/fp8.py's rule says, the smallest power
    of two at or above max|x| over the format's largest value (1 for zeros)."""
    a = np.asarray(jax.device_get(x), np.float32)
    amax, largest = float(np.max(np.abs(a))) or 1.0, float(ml_dtypes.finfo(dtype).max)
    e = math.frexp(amax / largest)[1]  # then made exact: largest * 2^e >= amax > largest * 2^(e-1)
    while math.ldexp(largest, e - 1) >= amax:
        e -= 1
    while math.ldexp(largest, e) < amax:
        e += 1
    scale = np.float32(math.ldexp(1.0, e))
    return (a / scale).astype(dtype).astype(np.float32), scale
