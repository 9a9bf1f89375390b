"""The GEMMs of one job's train step compiled for one H100 (tests/test_gpu_compile.py's FP8 tests):
each cuBLAS call's kind and operand types, the gathered arrays' element types and the all-reduces of a few
elements (maxima taken across devices), as JSON on stdout.

    .venv/bin/python tests/gpu_gemms.py --config configs/llama_tiny.yaml --dtype bfloat16 --model.matmul fp8
    .venv/bin/python tests/gpu_gemms.py --gpus 8 --config ... --mesh.fsdp 8     # one host of 8
    .venv/bin/python tests/gpu_gemms.py --hosts 16 --gpus 8 --config ...       # 16 hosts of 8
    .venv/bin/python tests/gpu_gemms.py --without_fp8_options --config ...    # the job's start refuses it

"census": observe/gemms.py's counts; "refused": the line the job's start gives its step, or null.

Its own process: the CUDA plugin must never enter pytest's (jaxtrain/plan/targets.py use_plugin).
"""

import collections
import json
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxtrain.plan import targets  # noqa: E402

targets.use_plugin()

from jaxtrain import xla_env  # noqa: E402
from jaxtrain.config import ConfigError, load_config  # noqa: E402
from jaxtrain.observe import gemms as census  # noqa: E402
from jaxtrain.run.build import build  # noqa: E402
from jaxtrain.run.job import Job  # noqa: E402

# A cuBLAS call: its result type(s), operands and target, `%x = (bf16[..], s8[..]) custom-call(%a, ...)`
CALL = re.compile(r"= \(*(\w+)\[[^\n]*? custom-call\(([^)]*)\), custom_call_target=\"(__cublas[^\"]*)\"")
TRITON = re.compile(r"kind=kCustom[^\n]*?\"kind\":\"(__triton[a-z_]*gemm[a-z_]*)\"")
# An all-gather's result (a combined one's tuple of arrays; an async one's at its -done), each array's type
GATHER = re.compile(r"= (.*?) all-gather(?:-done)?\(")
# An all-reduce's result (an async one's at its start), for the small ones: a max taken across devices
REDUCE = re.compile(r"= (\w+)\[([\d,]*)\][^\n]*? all-reduce(?:-start)?\(")


def gemms(hlo: str) -> dict:
    """{GEMM kind: count}, {cuBLAS kind: {"lhs_type rhs_type": count}}, {element type: arrays gathered},
    {element type: all-reduces of at most 8 elements (maxima, combined or not)}."""
    types = dict(re.findall(r"%([\w.\-]+) = \(?(\w+)\[", hlo))  # each value's element type
    kinds: collections.Counter = collections.Counter()
    operands: dict = collections.defaultdict(collections.Counter)
    for _, args, kind in CALL.findall(hlo):
        names = [a.strip().lstrip("%") for a in args.split(",")][:2]
        kinds[kind] += 1
        operands[kind][" ".join(types.get(n, "?") for n in names)] += 1
    kinds.update(TRITON.findall(hlo))  # GEMMs XLA emitted as Triton fusions (its default, Triton on)
    gathers = collections.Counter(t for result in GATHER.findall(hlo) for t in re.findall(r"(\w+)\[", result))
    sizes = ((t, math.prod(int(d) for d in dims.split(",") if d)) for t, dims in REDUCE.findall(hlo))
    small = collections.Counter(t for t, n in sizes if n <= 8)
    return {
        "kinds": dict(kinds),
        "operands": {k: dict(v) for k, v in operands.items()},
        "gathers": dict(gathers),
        "small_all_reduces": dict(small),
    }


def main(argv: list[str]) -> None:
    without = tuple(xla_env.FP8_OPTIONS) if "--without_fp8_options" in argv else ()
    argv = [a for a in argv if a != "--without_fp8_options"]
    sizes = {}
    for flag in ("--hosts", "--gpus"):  # hosts x GPUs a host, 1 x 1 unless given
        sizes[flag] = int(argv.pop(argv.index(flag) + 1)) if flag in argv else 1
        argv = [a for a in argv if a != flag]
    target = targets.get("h100")
    devices = targets.target_devices(target, sizes["--hosts"], sizes["--gpus"])
    run = build(Job.of_devices(load_config(argv), devices))
    options = {k: v for k, v in (run.compiler_options or {}).items() if k not in without} or None
    with targets.cudnn_gates(target):
        compiled = run.train_step.lower(run.target, run.batch_shape).compile(options)  # as compile_train
    refused = None
    try:
        run.check_gemms(compiled)  # what the job's start checks of its step (run/build.py compile_train)
    except ConfigError as e:
        refused = str(e)
    hlo = compiled.as_text()
    print(json.dumps(gemms(hlo) | {"census": census.counts(census.census(hlo)), "refused": refused}))


if __name__ == "__main__":
    main(sys.argv[1:])
