r"""Train a GPT language model with jaxtrain.

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
    python scripts/train.py --task chat --resume_from hf:Qwen2.5-0.5B-Instruct --system "Be brief." \
        --prompt "What is 2 plus 3?" --temperature 0     # 0: greedy
    python scripts/train.py --config configs/default.yaml --init_from runs/default --run_dir runs/finetune
"""

import sys

from jaxtrain import xla_env  # noqa: F401  isort: skip  (first: it records the launch time)
from jaxtrain.cluster.shutdown import exit_on_user_error
from jaxtrain.run.cli import main

if __name__ == "__main__":
    sys.exit(exit_on_user_error(main)(sys.argv[1:], __doc__ or ""))
