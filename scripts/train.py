"""Train a GPT language model with jaxtrain.

One process, every local device (CPU, one GPU, or a GPU box):
    python scripts/train.py --config configs/default.yaml
    python scripts/train.py --config configs/tiny.yaml --batch_size 64 --optim.lr=3e-4
Your own data (see scripts/prepare_data.py):
    python scripts/train.py --config configs/gpt2_124m.yaml --train_data_path data/train.bin \
        --valid_data_path data/val.bin
Several local processes, many hosts, SLURM (same script, unchanged):
    python scripts/run_distributed.py --mode manual --world-size 4 -- --config configs/tiny.yaml
    scripts/launch_multi_node.sh 10.0.0.1 2 8 -- --config configs/gpt2_124m.yaml
    python scripts/run_distributed.py --mode slurm --nodes 2 -- --config configs/gpt2_124m.yaml
Relaunching the same command resumes from the run dir's latest complete checkpoint.
Evaluate or sample a checkpoint (jaxtrain/run/tasks.py), or start a new run from its params:
    python scripts/train.py --task test --resume_from runs/default/checkpoints/300
    python scripts/train.py --task predict --resume_from runs/default --prompt "def " --max_new_tokens 256
    python scripts/train.py --config configs/default.yaml --init_from runs/default --run_dir runs/finetune
"""

import sys

from jaxtrain import xla_env  # isort: skip  (first: it records the launch time)
from jaxtrain.cluster.detect import detect
from jaxtrain.cluster.shutdown import exit_on_user_error
from jaxtrain.config import load_config
from jaxtrain.hf.config import with_hf_model


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    cfg = load_config(sys.argv[1:] if argv is None else argv, __doc__ or "", fill=with_hf_model)
    launch = detect(cfg.dist)  # where this process sits: once per launch, before jax starts
    # Before jax starts a backend: XLA reads XLA_FLAGS once (jaxtrain/xla_env.py).
    xla_env.set_flags(cfg, launch)
    from jaxtrain.run.tasks import run_task  # imports jax

    run_task(cfg, launch, launch_time=xla_env.LAUNCH_TIME)


if __name__ == "__main__":
    main()
