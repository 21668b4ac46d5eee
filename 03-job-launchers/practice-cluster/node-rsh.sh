#!/usr/bin/env bash
# An ssh stand-in for launchers that log in to nodes (mpirun, pdsh): `node-rsh.sh NODE COMMAND...` runs the
# command line on that node of the practice cluster, as `ssh NODE COMMAND...` would on a real one.
#
#   mpirun --mca plm_rsh_agent "$PWD/practice-cluster/node-rsh.sh" --host node0:2,node1:2 ...
set -euo pipefail
node=${1:?usage: node-rsh.sh NODE COMMAND...}
shift
# NOTE: like ssh, join the arguments into one command line for a shell on the node.
exec "$(dirname "${BASH_SOURCE[0]}")/on-node.sh" "$node" sh -c "$*"
