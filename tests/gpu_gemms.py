"""The GEMMs of one job's train step compiled for one H100 (tests/test_gpu_compile.py's FP8 tests):
each cuBLAS call's kind and operand types, and the all-gathers' element types, as JSON on stdout.

    .venv/bin/python tests/gpu_gemms.py --config configs/llama_tiny.yaml --dtype bfloat16 --model.matmul fp8
    .venv/bin/python tests/gpu_gemms.py --gpus 8 --config ... --mesh.fsdp 8     # one host of 8

Its own process: the CUDA plugin must never enter pytest's (jaxtrain/plan/targets.py use_plugin).
"""

import collections
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxtrain.plan import targets  # noqa: E402

targets.use_plugin()

from jaxtrain.config import load_config  # noqa: E402
from jaxtrain.run.build import build  # noqa: E402
from jaxtrain.run.job import Job  # noqa: E402

# A cuBLAS call: its result type(s), operands and target, `%x = (bf16[..], s8[..]) custom-call(%a, ...)`
CALL = re.compile(r"= \(*(\w+)\[[^\n]*? custom-call\(([^)]*)\), custom_call_target=\"(__cublas[^\"]*)\"")
GATHER = re.compile(r"= \(*(\w+)\[[^\n]*? all-gather(?:-start)?\(")


def gemms(hlo: str) -> dict:
    """{kind: count}, {kind: {"lhs_type rhs_type": count}} and {element type: all-gathers}."""
    types = dict(re.findall(r"%([\w.\-]+) = \(?(\w+)\[", hlo))  # each value's element type
    kinds: collections.Counter = collections.Counter()
    operands: dict = collections.defaultdict(collections.Counter)
    for _, args, kind in CALL.findall(hlo):
        names = [a.strip().lstrip("%") for a in args.split(",")][:2]
        kinds[kind] += 1
        operands[kind][" ".join(types.get(n, "?") for n in names)] += 1
    gathers = collections.Counter(GATHER.findall(hlo))
    return {
        "kinds": dict(kinds),
        "operands": {k: dict(v) for k, v in operands.items()},
        "gathers": dict(gathers),
    }


def main(argv: list[str]) -> None:
    gpus = int(argv.pop(argv.index("--gpus") + 1)) if "--gpus" in argv else 1  # on one host
    argv = [a for a in argv if a != "--gpus"]
    target = targets.get("h100")
    run = build(Job.of_devices(load_config(argv), targets.target_devices(target, 1, gpus)))
    with targets.cudnn_gates(target):
        hlo = run.compile_train().as_text()
    print(json.dumps(gemms(hlo)))


if __name__ == "__main__":
    main(sys.argv[1:])
