r"""Plan a training job on GPUs you do not have: compile its train and eval steps for the target
with XLA's real GPU compiler (no GPU, no CUDA driver), then print per-device memory, whether it
fits, the attention kernel, the collectives of one optimizer step and a step-time LOWER BOUND
(jaxtrain/plan/compiled.py says how it is computed; it is a floor, not a prediction).

    make gpu-plugin                                   # once per jax version: the CUDA plugin
    .venv/bin/python scripts/plan.py --config configs/gpt2_124m.yaml --target h100          # 1 x 8
    .venv/bin/python scripts/plan.py --config configs/gpt2_124m.yaml --target h100 --hosts 2 \
        --mesh.fsdp 8 --json plan.json
    .venv/bin/python scripts/plan.py --config configs/gpt2_124m.yaml --target a100 --search

Takes every flag of scripts/train.py, plus --target (jaxtrain/plan/targets.py), --hosts N,
--gpus_per_host G (default 8), --json FILE, --search (compile the meshes and remat settings that
fit, ranked by the forecast), --expert_load X (a mixture of experts' forecast at its most loaded
expert's rows over an even share: a run's measured expert_load_max_mean, or 1 for routing forced
even; default the capacity factor). Exit 0: fits; 1: does not fit (the nearest settings that fit
are printed); 2: bad input.
"""

import sys

from jaxtrain.cluster.shutdown import exit_on_user_error
from jaxtrain.plan.cli import main

if __name__ == "__main__":
    sys.exit(exit_on_user_error(main)(sys.argv[1:], __doc__ or ""))
