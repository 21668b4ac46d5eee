#!/usr/bin/env bash
# Tear down the practice cluster that up.sh started: its daemons (by their pid files, never by name), every
# process still running inside its node namespaces (jobs), the namespaces and the bridge it created.
# Safe to run twice, and after a failed up.sh. The state folder (logs, slurm.conf) is kept for reading.
#
#   sudo practice-cluster/down.sh [STATE_DIR]    # default: $PRACTICE_CLUSTER_DIR or /tmp/practice-cluster
set -uo pipefail

dir=$(realpath -m "${1:-${PRACTICE_CLUSTER_DIR:-/tmp/practice-cluster}}")
[[ $EUID -eq 0 ]] || { echo "error: run as root (sudo $0)" >&2; exit 1; }

# Stop the process in a pid file, if it is still the program we started there (pids get reused).
stop_pidfile() {
    local pidfile=$1 program=$2 pid
    [[ -s $pidfile ]] || return 0
    pid=$(<"$pidfile")
    if [[ $pid =~ ^[0-9]+$ && $(cat "/proc/$pid/comm" 2>/dev/null) == "$program" ]]; then
        kill -TERM "$pid" 2>/dev/null
        for _ in $(seq 50); do [[ -e /proc/$pid ]] || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null
    fi
    rm -f "$pidfile"
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

for node in "${namespaces[@]}"; do stop_pidfile "$dir/slurmd-$node.pid" slurmd; done
stop_pidfile "$dir/slurmctld.pid" slurmctld
for node in "${namespaces[@]}"; do kill_namespace_processes "$node" TERM; done
sleep 0.5
for node in "${namespaces[@]}"; do kill_namespace_processes "$node" KILL; done
stop_pidfile "$dir/munged.pid" munged
rm -f "$dir/munge/munged.pid"

for entry in "${created[@]}"; do
    case $entry in
        netns\ *) ip netns del "${entry#netns }" 2>/dev/null ;;
    esac
done
for entry in "${created[@]}"; do
    case $entry in
        link\ *) ip link del "${entry#link }" 2>/dev/null ;;
    esac
done
rm -f "$dir/created"
echo "practice cluster in $dir is down"
