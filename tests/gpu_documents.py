"""What the GPU program of a step with documents masked holds (tests/test_gpu_compile.py), compiled
for a target with the CUDA plugin, which never enters pytest's own process.

    .venv/bin/python tests/gpu_documents.py h100 [FLAG ...]    # one JSON line on stdout

Prints the array shapes of the compiled train step that have two dims of at least the window's
length (a T x S array), and each cuDNN attention call's target, operand count and packed-document
bound (max_seg_per_batch), and its q operand's shape.
"""

import json
import re
import sys

LLAMA_128K = ["--config", "configs/llama3_8b_128k.yaml", "--model.doc_eos", "128001"]


def main(target_name: str, flags: list[str]) -> None:
    from jaxtrain.plan import targets

    targets.use_plugin()
    from jaxtrain.config import load_config  # import jax, so after use_plugin
    from jaxtrain.run.build import build
    from jaxtrain.run.job import Job

    cfg = load_config([*LLAMA_128K, *flags])
    target = targets.get(target_name)
    run = build(Job.of_devices(cfg, targets.target_devices(target, 1, cfg.mesh.context)))
    with targets.cudnn_gates(target):
        text = run.compile_train().as_text()
    t = cfg.model.seq_len
    shapes = {m.group(0) for m in re.finditer(r"\b[a-z]\w*\[([\d,]+)\]", text)}
    long = sorted(s for s in shapes if sum(int(d) >= t for d in re.findall(r"\d+", s.split("[")[1])) >= 2)
    calls = []
    for line in text.splitlines():
        target_call = re.search(r'custom_call_target="(__cudnn\$fmha\w*)"', line)
        if target_call:
            seg = re.search(r'"max_seg_per_batch":\s*"?(\d+)', line)
            operands = line.split("custom-call(", 1)[1].split(")", 1)[0].count("%")
            q = re.search(r"operand_layout_constraints=\{\w+\[([\d,]+)\]", line)
            calls.append(
                {
                    "target": target_call.group(1),
                    "operands": operands,
                    "q": q.group(1) if q else "",
                    "max_seg": int(seg.group(1)) if seg else 0,
                }
            )
    print(json.dumps({"seq_len": t, "long_shapes": long, "cudnn_calls": calls}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
