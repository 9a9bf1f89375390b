#!/usr/bin/env bash
# The common ways to start jaxtrain: pick one, see the exact command, run it if you like.
#
#     scripts/quick_start_examples.sh            # menu
#     scripts/quick_start_examples.sh 3          # print scenario 3's command
#     scripts/quick_start_examples.sh 3 --run    # print it and run it
#     scripts/quick_start_examples.sh --list     # print every command
#
# Commands use configs/tiny.yaml (seconds on a CPU); use your own config for real runs.
# Placeholders in <angle brackets> must be replaced before running.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=python
[[ -x .venv/bin/python ]] && PY=.venv/bin/python

titles=(
    "One device (CPU, or one GPU)"
    "One host, every device in one process (a GPU box; on CPU: 4 fake devices)"
    "One host, 2 processes (the GPUs are split between them; on CPU each has one device)"
    "Many hosts, one command on the first host (HOSTFILE lists the hosts, started over ssh)"
    "Many hosts, started by hand (run on each host with its own NODE_RANK)"
    "SLURM: submit from a login node and follow the log"
    "SLURM: write an sbatch file to edit, keep and submit"
    "SLURM: inside salloc (srun starts one task per node)"
    "Health check: can these processes train together? (2 local processes)"
    "Try SLURM on this machine: a one-node cluster on localhost (root, apt)"
    "Try many hosts on this machine: two network namespaces (root)"
)
commands=(
    "$PY scripts/train.py --config configs/tiny.yaml"
    "XLA_FLAGS=--xla_force_host_platform_device_count=4 $PY scripts/train.py --config configs/tiny.yaml"
    "$PY scripts/run_distributed.py --mode manual --world-size 2 -- --config configs/tiny.yaml"
    "HOSTFILE=<hosts.txt> scripts/launch_multi_node.sh <first-host-ip> <num-nodes> <gpus-per-node> -- --config configs/tiny.yaml"
    "NODE_RANK=<0..N-1> scripts/launch_multi_node.sh <first-host-ip> <num-nodes> <gpus-per-node> -- --config configs/tiny.yaml"
    "$PY scripts/run_distributed.py --mode slurm --nodes 2 --gpus-per-node 8 --time 01:00:00 --follow -- --config configs/tiny.yaml"
    "$PY scripts/run_distributed.py --mode create_slurm --nodes 2 --gpus-per-node 8 --time 04:00:00 --sbatch-script slurm_scripts/my_job.sh -- --config configs/tiny.yaml && sbatch slurm_scripts/my_job.sh"
    "salloc --nodes 2 --ntasks-per-node 1 $PY scripts/run_distributed.py --mode slurm -- --config configs/tiny.yaml"
    "$PY scripts/run_distributed.py --mode manual --world-size 2 --script scripts/test_distributed.py"
    "sudo scripts/dev/local_slurm.sh && $PY scripts/run_distributed.py --mode slurm --ntasks-per-node 2 --follow -- --config configs/tiny.yaml"
    "sudo scripts/dev/fake_hosts.sh up jtq 10.213.9 > /tmp/jtq_hosts && HOSTFILE=/tmp/jtq_hosts JAXTRAIN_RSH='scripts/dev/fake_hosts.sh rsh' scripts/launch_multi_node.sh 10.213.9.1 2 0 -- --config configs/tiny.yaml; sudo scripts/dev/fake_hosts.sh down jtq"
)

show() { printf '\n%s\n    %s\n' "${titles[$1 - 1]}" "${commands[$1 - 1]}"; }

run() {
    if [[ ${commands[$1 - 1]} == *"<"*">"* ]]; then
        echo "fill in the <placeholders> first, then run the command yourself" >&2
        return 2
    fi
    echo "+ ${commands[$1 - 1]}" >&2
    bash -c "${commands[$1 - 1]}"
}

valid() { [[ $1 =~ ^[0-9]+$ ]] && (($1 >= 1 && $1 <= ${#titles[@]})); }

if [[ $# -gt 0 ]]; then
    case $1 in
        --list) for i in "${!titles[@]}"; do show $((i + 1)); done; exit 0 ;;
        -h | --help) sed -n '2,10p' "$0"; exit 0 ;;
    esac
    valid "$1" || { echo "error: scenario must be 1..${#titles[@]} or --list, got '$1'" >&2; exit 2; }
    [[ $# -eq 1 || ($# -eq 2 && $2 == --run) ]] || { echo "error: usage: $0 [N [--run] | --list]" >&2; exit 2; }
    show "$1"
    [[ ${2:-} == --run ]] && run "$1"
    exit 0
fi

while true; do
    echo
    echo "jaxtrain quick start: which situation are you in?"
    for i in "${!titles[@]}"; do printf '  %2d) %s\n' $((i + 1)) "${titles[i]}"; done
    echo "   q) quit"
    read -r -p "> " choice || exit 0
    [[ $choice == q ]] && exit 0
    valid "$choice" || { echo "pick 1..${#titles[@]} or q"; continue; }
    show "$choice"
    read -r -p "Run it now? [y/N] " answer || exit 0
    if [[ $answer == [yY]* ]]; then
        run "$choice" || echo "(exit code $?)"
    fi
done
