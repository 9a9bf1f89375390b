#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, for tests and for trying the SLURM launch path.
#
#     sudo scripts/dev/local_slurm.sh          # install (apt) if needed, configure, start, wait
#     sinfo; srun -n 2 hostname                # then use it like any cluster
#     sudo scripts/dev/local_slurm.sh stop     # stop the daemons, munged too (packages and config stay)
#
# Idempotent: safe to run when the cluster is already up (it then only checks it).
# Needs root and apt (Debian/Ubuntu). Facts this relies on: inside containers there is no
# cgroup control, so processes are tracked by parent id (proctrack/linuxproc) and not bound
# (task/none); munged must run as the munge user with its key in /etc/munge.
set -euo pipefail

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
LOG_DIR=/var/log/slurm
WAIT_S=${LOCAL_SLURM_WAIT_S:-60}

die() { echo "error: $*" >&2; exit "${2:-1}"; }

[[ $(id -u) -eq 0 ]] || die "run as root (it installs packages and starts system daemons)" 2
[[ $# -le 1 && ${1:-start} =~ ^(start|stop)$ ]] || die "usage: $0 [start|stop]" 2

# The pid in a daemon's pid file, if that process is alive and is that daemon: a pid file left from
# another boot or container may name a live process that is something else.
pid_of() {
    local pid
    [[ -s $1 ]] && pid=$(<"$1") && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]] && echo "$pid"
}
running() { pid_of "/run/$1.pid" "$1" >/dev/null; }
munge_answers() { timeout 5 bash -c 'munge -n </dev/null | unmunge' >/dev/null 2>&1; }

stop_daemons() {
    local d pid
    for d in slurmd slurmctld; do
        if pid=$(pid_of "/run/$d.pid" "$d"); then
            kill "$pid"
        fi
    done
    for _ in $(seq 50); do
        running slurmd || running slurmctld || return 0
        sleep 0.2
    done
    die "slurmd/slurmctld did not stop"
}

if [[ ${1:-start} == stop ]]; then
    stop_daemons
    munge_answers && munged --stop >/dev/null
    echo "local SLURM stopped"
    exit 0
fi

install_packages() {
    local missing=()
    command -v slurmctld >/dev/null || missing+=(slurmctld)
    command -v slurmd >/dev/null || missing+=(slurmd)
    command -v sinfo >/dev/null || missing+=(slurm-client)
    command -v munged >/dev/null || missing+=(munge)
    [[ ${#missing[@]} -eq 0 ]] && return 0
    command -v apt-get >/dev/null || die "SLURM is not installed and apt-get is missing: install ${missing[*]}" 2
    echo "installing ${missing[*]} with apt-get"
    apt-get update -qq
    # The packages' own start scripts fail without systemd; this script starts the daemons.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" \
        >/tmp/local_slurm_apt.log 2>&1 || die "apt-get install ${missing[*]} failed; see /tmp/local_slurm_apt.log"
}

start_munge() {
    mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
    chmod 0700 /etc/munge && chmod 0400 /etc/munge/munge.key
    munge_answers && return 0
    # No answer: a munged that is not ours to reach (left from another session or container, or
    # hung) may still hold the socket's lock, and a new munged then refuses to start ("Failed to
    # lock ... pid N bound to socket"). Stop ours if it is one, and start on fresh files.
    local pid
    if pid=$(pid_of /run/munge/munged.pid munged); then
        kill "$pid" 2>/dev/null || true
        sleep 0.5
    fi
    rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock /run/munge/munged.pid
    runuser -u munge -- munged
    for _ in $(seq 50); do
        munge_answers && return 0
        sleep 0.2
    done
    die "munged does not answer (munge -n | unmunge fails); see /var/log/munge/munged.log"
}

write_conf() {
    local host node_line tmp overrides=""
    host=$(hostname -s)
    # The node's real CPUs and memory, as slurmd sees them ("NodeName=vm CPUs=2 ... RealMemory=N").
    node_line=$(slurmd -C | grep '^NodeName=')
    [[ -n $node_line ]] || die "slurmd -C printed no NodeName line"
    if [[ $node_line =~ CPUs=1[[:space:]] ]]; then
        # The tests run 2 tasks on this node; config_overrides lets a 1-CPU machine claim 2.
        node_line="NodeName=$host CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 $(
            grep -o 'RealMemory=[0-9]*' <<<"$node_line")"
        overrides=SlurmdParameters=config_overrides
    fi
    mkdir -p "$CONF_DIR" "$LOG_DIR" /var/spool/slurmctld /var/spool/slurmd
    tmp=$(mktemp)
    # KillWait: seconds between SIGTERM and SIGKILL when a job is requeued, pre-empted or hits its
    # limit; the tiny test runs save their pre-emption checkpoint in about a second (SLURM's
    # default is 30). cred_expire: a requeued job may start again only this many seconds later
    # (default 120; 5 is the least slurmd takes: at 3 it says invalid and uses 120); then it waits
    # for the next scheduling pass (sched_interval, bf_interval: default 60 and 30 s). All short
    # here so the requeue tests run in seconds.
    cat >"$tmp" <<EOF
# Written by scripts/dev/local_slurm.sh: one-node development cluster on $host.
ClusterName=jaxtrain-dev
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=5
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
KillWait=10
MinJobAge=300
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
$overrides
$node_line State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    if cmp -s "$tmp" "$CONF"; then
        rm -f "$tmp"
        return 1  # unchanged
    fi
    mv "$tmp" "$CONF"
    chmod 0644 "$CONF"
    return 0
}

node_state() { sinfo -h -N -o '%t' 2>/dev/null | head -n1; }

install_packages
start_munge
if write_conf; then
    echo "wrote $CONF"
    stop_daemons  # pick up the new configuration
fi
# -c: a controller we start forgets the jobs of its last life; one left "completing" when the
# daemons stopped holds the node for its whole timeout (44 s in a test run) before any new job runs.
running slurmctld || slurmctld -c
running slurmd || slurmd

host=$(hostname -s)
state=""
for _ in $(seq $((WAIT_S * 2))); do
    state=$(node_state)
    case $state in
        idle | mix | alloc) echo "local SLURM up: node $host $state"; exit 0 ;;
        down* | drain* | drng*) scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
done
die "node $host is '${state:-unknown}' after ${WAIT_S} s; see $LOG_DIR/slurmctld.log and $LOG_DIR/slurmd.log"
