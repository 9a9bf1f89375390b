#!/usr/bin/env bash
# Two "hosts" on one Linux machine: network namespaces joined by a veth pair, each with its own
# address, to try the multi-host launch path for real (root only).
#
#     sudo scripts/dev/fake_hosts.sh up jt 10.213.7 > hosts.txt     # namespaces jt0, jt1: .1 and .2
#     HOSTFILE=hosts.txt JAXTRAIN_RSH="scripts/dev/fake_hosts.sh rsh" \
#         scripts/launch_multi_node.sh 10.213.7.1 2 0 -- --config configs/tiny.yaml
#     sudo scripts/dev/fake_hosts.sh down jt
#
# `rsh ADDRESS COMMAND` runs COMMAND with bash inside the namespace that owns ADDRESS, like ssh,
# under a host name of its own (the namespace's name, e.g. jt0), as the health check names hosts.
# Gloo binds to the address the host name resolves to, so each namespace gets its own hosts file
# (/etc/netns/NAME/hosts, which `ip netns exec` mounts over /etc/hosts). `ip netns exec` also gives
# every command a mount namespace of its own: a mount made by COMMAND is seen by it alone.
set -euo pipefail

MAP_DIR=/run/jaxtrain_fake_hosts # ADDRESS -> namespace, for rsh

die() { echo "error: $1" >&2; exit 2; }

up() {
    local prefix=$1 net=$2 i ns addr
    [[ $net =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "subnet must be the first three numbers, e.g. 10.213.7"
    down "$prefix" 2>/dev/null || true
    mkdir -p "$MAP_DIR"
    ip link add "${prefix}v0" type veth peer name "${prefix}v1"
    for i in 0 1; do
        ns=$prefix$i addr=$net.$((i + 1))
        ip netns add "$ns"
        mkdir -p "/etc/netns/$ns"
        printf '127.0.0.1 localhost\n%s %s %s\n' "$addr" "$ns" "$(hostname)" >"/etc/netns/$ns/hosts"
        ip link set "${prefix}v$i" netns "$ns"
        ip -n "$ns" addr add "$addr/24" dev "${prefix}v$i"
        ip -n "$ns" link set "${prefix}v$i" up
        ip -n "$ns" link set lo up
        echo "$ns" >"$MAP_DIR/$addr"
        echo "$addr"
    done
}

down() {
    local prefix=$1 i addr
    for i in 0 1; do
        for addr in "$MAP_DIR"/*; do
            [[ -f $addr && $(cat "$addr") == "$prefix$i" ]] && rm -f "$addr"
        done
        # deleting a namespace also deletes the veth end inside it, and so the pair
        ip netns del "$prefix$i" 2>/dev/null || true
        rm -rf "/etc/netns/$prefix$i"
    done
    ! ip link show "${prefix}v0" >/dev/null 2>&1 || ip link del "${prefix}v0"
}

rsh() {
    local ns
    [[ -f $MAP_DIR/$1 ]] || die "no fake host has address $1 (run: $0 up PREFIX SUBNET)"
    ns=$(cat "$MAP_DIR/$1")
    # shellcheck disable=SC2016 # expanded by the inner shell
    exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec bash -c "$1"' "$ns" "$2"
}

[[ $(id -u) -eq 0 ]] || die "run as root (network namespaces)"
case ${1:-} in
    up) [[ $# -eq 3 ]] || die "usage: $0 up PREFIX SUBNET"; up "$2" "$3" ;;
    down) [[ $# -eq 2 ]] || die "usage: $0 down PREFIX"; down "$2" ;;
    rsh) [[ $# -eq 3 ]] || die "usage: $0 rsh ADDRESS COMMAND"; rsh "$2" "$3" ;;
    *) die "usage: $0 up PREFIX SUBNET | down PREFIX | rsh ADDRESS COMMAND" ;;
esac
