r"""Prove jaxtrain on this machine's GPU in minutes: devices and their speed, each GPU-only kernel
against its reference (forward and backward), short trains with each kernel choice, a benchmark.

    python scripts/gpu_check.py --out gpu_check_out                 # every stage, 540 s budget
    python scripts/gpu_check.py --out out --stages device,kernels --budget_s 200
    python scripts/gpu_check.py --out out --stages train --train_runs gpt_xla,gpt_cudnn --train_steps 20

Stages, in order (docs/gpu_check.md says what each checks and when it passes): device, kernels,
train, bench. Each runs in processes of its own with a time limit, so a kernel that aborts or
hangs fails only itself; no stage starts past --budget_s. Its first line names the versions of
jax, jaxlib and the CUDA plugin that run and, where they are not constraints.txt's, why
(--versions_why). Writes OUT/gpu_check.json (rewritten after every stage) and OUT/<stage>.log, and
prints a summary table last, judged by the rules of jaxtrain/health/gpu_rules.py (their version
recorded). Exit 0 when every stage passed, 1 when one did not, 2 on bad arguments. On a CPU the
same stages run the reference paths (small), which is what the tests do.

On a lent GPU machine, with the missing packages carried as wheels in .whl/ (its jax 0.11.2 and
CUDA 13 plugin stay: constraints.txt's jaxlib and CUDA 12 plugin are too big to carry there):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && \
        python3 scripts/gpu_check.py --out $OUT --budget_s 540 --versions_why "the lent machine's own \
        jax; constraints.txt's jaxlib (349 MB installed) and CUDA 12 plugin (3.2 GB) cannot be carried"
"""

import sys

from jaxtrain.cluster.shutdown import exit_on_user_error
from jaxtrain.health.gpu_check import main

if __name__ == "__main__":
    sys.exit(exit_on_user_error(main)(sys.argv[1:], __doc__ or ""))
