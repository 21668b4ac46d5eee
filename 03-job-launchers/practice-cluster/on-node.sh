#!/usr/bin/env bash
# Run a command "on" one node of the practice cluster: inside its network, hostname and /etc/hosts, in the
# current folder (both nodes see this machine's files), like `ssh nodeX 'cd $PWD && ...'` on a real cluster.
#
#   practice-cluster/on-node.sh node1 hostname -I       # as root
set -euo pipefail
dir=$(realpath -m "${PRACTICE_CLUSTER_DIR:-/tmp/practice-cluster}")
node=${1:?usage: on-node.sh NODE COMMAND [ARGS...]}
shift
pidfile=$dir/slurmd-$node.pid
[[ -s $pidfile ]] || { echo "error: no $pidfile: is the practice cluster in $dir up (practice-cluster/up.sh)?" >&2; exit 1; }
# NOTE: the node's slurmd holds its namespaces; entering them is what logging in to that node would give.
exec nsenter --target "$(<"$pidfile")" --net --uts --mount -- env -C "$PWD" "$@"
