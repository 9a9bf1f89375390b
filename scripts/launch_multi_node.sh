#!/usr/bin/env bash
# Start training on many hosts with one command, one process per host using all its GPUs.
#
# From the first host, start every host listed in HOSTFILE (one host per line) over ssh:
#     HOSTFILE=hosts.txt scripts/launch_multi_node.sh 10.0.0.1 2 8 -- --config configs/gpt2_124m.yaml
# Or start each host by hand (same command everywhere, its own NODE_RANK):
#     NODE_RANK=0 scripts/launch_multi_node.sh 10.0.0.1 2 8 -- --config configs/gpt2_124m.yaml
#     NODE_RANK=1 scripts/launch_multi_node.sh 10.0.0.1 2 8 -- --config configs/gpt2_124m.yaml
# CPU hosts: gpus_per_node 0.  Coordinator port: 10.0.0.1:29600, else JAXTRAIN_PORT (29500).
#
# Arguments: <coordinator_ip[:port]> <num_nodes> <gpus_per_node> [-- training arguments]
# Environment:
#   HOSTFILE          hosts, one per line (# comments allowed); line i is node i. The same
#                     repository path must exist on every host (JAXTRAIN_REMOTE_DIR to change it).
#   JAXTRAIN_RSH      remote shell, called as `$JAXTRAIN_RSH HOST 'COMMAND'` (default: ssh);
#                     it must run COMMAND with a shell on HOST, like ssh does.
#   NODE_RANK         run only that node's process, here.
#   JAXTRAIN_SCRIPT   script to run (default scripts/train.py; scripts/test_distributed.py checks the hosts)
#   JAXTRAIN_PYTHON   interpreter (default .venv/bin/python when present, else python3)
#   JAXTRAIN_FORWARD_ENV  more variable names to pass to the hosts (these always are: XLA_FLAGS,
#                     JAX_PLATFORMS, XLA_PYTHON_CLIENT_PREALLOCATE, XLA_PYTHON_CLIENT_MEM_FRACTION,
#                     WANDB_MODE, WANDB_PROJECT)
#   XLA_PYTHON_CLIENT_PREALLOCATE  false unless you set it (JAX then takes GPU memory as needed)
#
# Why one process per host: JAX drives all of a host's GPUs from one process, so there are fewer
# processes to start, watch and connect; use run_distributed.py --node-rank/--nproc-per-node for
# one process per GPU.
# If any host fails, the others are stopped (the launcher asks each host to stop its processes,
# and they save a checkpoint first) and this exits with the first failing host's exit code, naming it:
# 75 when training was pre-empted (a checkpoint is saved: run the same command again to resume),
# 2 bad input, 128+N when a process was killed by signal N (see scripts/run_distributed.py).
# Ctrl-C stops every host the same way (Ctrl-C again: at once). If this launcher dies, however
# (kill -9 too), its connections close and every host kills its processes within a second.
# Health check of the hosts, the same way:
#     HOSTFILE=hosts.txt JAXTRAIN_SCRIPT=scripts/test_distributed.py scripts/launch_multi_node.sh \
#         10.0.0.1 2 8 -- --checkpoint_dir /shared/ckpt --json health.json
set -euo pipefail

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then  # the comment above is the help
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
  exit 0
fi

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SELF=scripts/launch_multi_node.sh
FORWARD=(XLA_FLAGS JAX_PLATFORMS XLA_PYTHON_CLIENT_PREALLOCATE XLA_PYTHON_CLIENT_MEM_FRACTION WANDB_MODE
    WANDB_PROJECT JAXTRAIN_SCRIPT JAXTRAIN_PYTHON JAXTRAIN_PORT)

usage() {
    echo "error: $1; usage: $SELF <coordinator_ip[:port]> <num_nodes> <gpus_per_node> [-- train args]" >&2
    exit 2
}

[[ $# -ge 3 ]] || usage "expected 3 arguments, got $#"
coordinator=$1 num_nodes=$2 gpus_per_node=$3
shift 3
if [[ $# -gt 0 ]]; then
    [[ $1 == -- ]] || usage "training arguments go after --, got '$1'"
    shift
fi
train_args=("$@")

[[ $num_nodes =~ ^[1-9][0-9]*$ ]] || usage "num_nodes must be a positive integer, got '$num_nodes'"
[[ $gpus_per_node =~ ^(0|[1-9][0-9]*)$ ]] || usage "gpus_per_node must be an integer >= 0, got '$gpus_per_node'"
if [[ $coordinator != *:* ]]; then
    coordinator=$coordinator:${JAXTRAIN_PORT:-29500}
fi
if ! [[ $coordinator =~ ^[A-Za-z0-9._-]+:([0-9]{1,5})$ ]] || ! ((10#${BASH_REMATCH[1]} > 0 && 10#${BASH_REMATCH[1]} < 65536)); then
    usage "coordinator must be HOST or HOST:PORT, got '$coordinator'"
fi

interpreter() { # JAXTRAIN_PYTHON, else the repository's .venv, else python3
    if [[ -n ${JAXTRAIN_PYTHON:-} ]]; then
        echo "$JAXTRAIN_PYTHON"
    elif [[ -x $REPO/.venv/bin/python ]]; then
        echo "$REPO/.venv/bin/python"
    else
        echo python3
    fi
}

# ------------------------------------------------------------------- one node, here
run_node() {
    local rank=$1 python
    if ! [[ $rank =~ ^[0-9]+$ ]] || ((10#$rank >= num_nodes)); then
        usage "NODE_RANK must be in 0..$((num_nodes - 1)), got '$rank'"
    fi
    cd "$REPO"
    python=$(interpreter)
    export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
    if ((gpus_per_node > 0)); then
        export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((gpus_per_node - 1)))}
    else
        export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
    fi
    local cmd=("$python" scripts/run_distributed.py --mode manual --rank "$rank" --world-size "$num_nodes"
        --coordinator "$coordinator" --script "${JAXTRAIN_SCRIPT:-scripts/train.py}" -- "${train_args[@]}")
    if [[ ${JAXTRAIN_STOP_ON_EOF:-0} != 1 ]]; then
        exec "${cmd[@]}"
    fi
    # Started by the launcher: a `stop` line on its connection (our stdin) asks for an orderly stop
    # (training saves a checkpoint); the connection closing means the launcher died or gave up, so
    # kill at once (the ranks die with their launcher, jaxtrain/cluster/lifeline.py).
    exec 3<&0
    "${cmd[@]}" </dev/null 3<&- &
    local child=$!
    (
        while read -r -u 3 line; do
            [[ $line == stop ]] && kill -TERM "$child" 2>/dev/null
        done
        kill -KILL "$child" 2>/dev/null || true
    ) &
    local watcher=$! rc=0
    trap 'kill -TERM "$child" 2>/dev/null || true' TERM INT HUP
    while kill -0 "$child" 2>/dev/null; do
        rc=0
        wait "$child" || rc=$?
    done
    kill "$watcher" 2>/dev/null || true
    exit "$rc"
}

if [[ -n ${NODE_RANK:-} ]]; then
    run_node "$NODE_RANK"
fi
if [[ -z ${HOSTFILE:-} ]]; then
    ((num_nodes == 1)) && run_node 0
    usage "set HOSTFILE (one host per line) to start $num_nodes nodes, or NODE_RANK to start one here"
fi
[[ -r $HOSTFILE ]] || usage "HOSTFILE $HOSTFILE is not a readable file"

# ------------------------------------------------------------------- every node, through JAXTRAIN_RSH
mapfile -t hosts < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$HOSTFILE" | grep -v '^$' || true)
((${#hosts[@]} >= num_nodes)) || usage "HOSTFILE $HOSTFILE lists ${#hosts[@]} hosts, need $num_nodes"
read -r -a rsh <<<"${JAXTRAIN_RSH:-ssh}"
command -v "${rsh[0]}" >/dev/null || usage "remote shell '${rsh[0]}' not found; set JAXTRAIN_RSH"

quote() { printf "'%s'" "${1//\'/\'\\\'\'}"; } # for any POSIX shell on the far side

remote_command() {
    local rank=$1 out name
    out="cd $(quote "${JAXTRAIN_REMOTE_DIR:-$REPO}") && exec env"
    out+=" $(quote "NODE_RANK=$rank") JAXTRAIN_STOP_ON_EOF=1"
    for name in "${FORWARD[@]}" ${JAXTRAIN_FORWARD_ENV:-}; do
        [[ -n ${!name+x} ]] && out+=" $(quote "$name=${!name}")"
    done
    out+=" bash $SELF $(quote "$coordinator") $num_nodes $gpus_per_node --"
    for arg in "${train_args[@]}"; do out+=" $(quote "$arg")"; done
    printf '%s' "$out"
}

echo "jaxtrain launch: $num_nodes node(s) ${hosts[*]:0:num_nodes}, coordinator $coordinator" >&2
nodes=()
for ((i = 0; i < num_nodes; i++)); do nodes+=("${hosts[i]}" "$(remote_command "$i")"); done
# The rule every launcher follows, written once (jaxtrain/launch/supervise.py): node 0 talks to the
# terminal, the others are prefixed [node i]; each node's stdin stays open while the launcher
# runs; the first node to fail names the exit code, and the others are stopped by closing theirs.
exec "$(interpreter)" -m jaxtrain.launch.supervise --rsh "${JAXTRAIN_RSH:-ssh}" -- "${nodes[@]}"
