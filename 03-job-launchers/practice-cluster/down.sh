#!/usr/bin/env bash
# Tear down the practice cluster that up.sh started: its daemons (by their pid files, never by name), every
# process still running inside its node namespaces (jobs), the namespaces and the bridge it created.
# Safe to run twice, and after a failed up.sh. The state folder (logs, slurm.conf) is kept for reading.
#
#   practice-cluster/down.sh [STATE_DIR]    # as root; default $PRACTICE_CLUSTER_DIR or /tmp/practice-cluster
set -uo pipefail

dir=$(realpath -m "${1:-${PRACTICE_CLUSTER_DIR:-/tmp/practice-cluster}}")
[[ $EUID -eq 0 ]] || { echo "error: run as root (sudo $0)" >&2; exit 1; }

# The pids in these pid files that still belong to the program we started there (pids get reused).
our_pids() {
    local program=$1 pidfile pid
    shift
    for pidfile in "$@"; do
        [[ -s $pidfile ]] || continue
        pid=$(<"$pidfile")
        [[ $pid =~ ^[0-9]+$ && $(cat "/proc/$pid/comm" 2>/dev/null) == "$program" ]] && echo "$pid"
    done
    return 0
}

# SIGTERM, up to 10 s to exit, then SIGKILL.
stop_pids() {
    (($# == 0)) && return 0
    kill -TERM "$@" 2>/dev/null
    for _ in $(seq 100); do
        local alive=0 pid
        for pid in "$@"; do [[ -e /proc/$pid ]] && alive=1; done
        ((alive)) || return 0
        sleep 0.1
    done
    kill -KILL "$@" 2>/dev/null
    return 0
}

# Kill whatever still runs inside one of our namespaces (job steps, torchrun, workers).
kill_namespace_processes() {
    local node=$1 signal=$2 pids
    pids=$(ip netns pids "$node" 2>/dev/null) || return 0
    [[ -n $pids ]] && kill "-$signal" $pids 2>/dev/null
    return 0
}

created=()
[[ -e $dir/created ]] && mapfile -t created <"$dir/created"
namespaces=()
for entry in "${created[@]}"; do [[ $entry == netns\ * ]] && namespaces+=("${entry#netns }"); done

slurmd_pidfiles=()
for node in "${namespaces[@]}"; do slurmd_pidfiles+=("$dir/slurmd-$node.pid"); done
sshd_pidfiles=()
for node in "${namespaces[@]}"; do sshd_pidfiles+=("$dir/sshd-$node.pid"); done
daemons=($(our_pids slurmd "${slurmd_pidfiles[@]}") $(our_pids slurmctld "$dir/slurmctld.pid")
    $(our_pids sshd "${sshd_pidfiles[@]}"))
stop_pids "${daemons[@]}"
for node in "${namespaces[@]}"; do kill_namespace_processes "$node" TERM; done
sleep 0.5
for node in "${namespaces[@]}"; do kill_namespace_processes "$node" KILL; done
stop_pids $(our_pids munged "$dir/munged.pid")
rm -f "$dir"/slurmd-*.pid "$dir"/sshd-*.pid "$dir/slurmctld.pid" "$dir/munged.pid" "$dir/munge/munged.pid"

# NOTE: links before namespaces: deleting a namespace frees its veth pair later, in the background, and an
# up.sh right after would find the old veth-node0 still there.
links=()
for entry in "${created[@]}"; do [[ $entry == link\ * ]] && links+=("${entry#link }"); done
for link in "${links[@]}"; do ip link del "$link" 2>/dev/null; done
for node in "${namespaces[@]}"; do ip netns del "$node" 2>/dev/null; done
for _ in $(seq 100); do
    gone=1
    for link in "${links[@]}"; do ip link show "$link" &>/dev/null && gone=0; done
    ((gone)) && break
    sleep 0.1
done
rm -f "$dir/created"
echo "practice cluster in $dir is down"
