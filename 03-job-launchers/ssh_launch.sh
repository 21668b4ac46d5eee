#!/usr/bin/env bash
# Launch a training script on the nodes listed in a hosts file, without a scheduler: one ssh per node, each
# running torchrun with that node's rank; the first host hosts the store (static rendezvous).
#
#   ./ssh_launch.sh HOSTS_FILE PROCS_PER_NODE SCRIPT [SCRIPT ARGS...]
#   ./ssh_launch.sh hosts 8 ../02-distributed-data-parallel/train_llm.py -e my-run
#   SSH="ssh -F /tmp/practice-cluster/ssh/config" ./ssh_launch.sh hosts 1 ...     # the practice cluster
#
# HOSTS_FILE: one hostname a line (# comments and blank lines skipped), the head node first. Every node runs
# the command in this folder with this machine's torchrun, so nodes need the same paths (shared home or the
# same image). Exits non-zero if any node fails; Ctrl-C (or SIGTERM) stops the training on every node.
# Environment: SSH (the ssh command, default "ssh"), MASTER_PORT (default 29500), FORWARD_ENV (more variable
# names to pass on; PATH, VIRTUAL_ENV, the socket interfaces and the Hugging Face and OpenMP settings always are).
set -euo pipefail
(($# >= 3)) || { echo "usage: $0 HOSTS_FILE PROCS_PER_NODE SCRIPT [ARGS...]" >&2; exit 2; }
hosts_file=$1 procs_per_node=$2
shift 2
mapfile -t hosts < <(awk 'NF && $1 !~ /^#/ { print $1 }' "$hosts_file")
if ((${#hosts[@]} == 0)); then
    echo "error: no hosts in $hosts_file; write one hostname a line, the head node first" >&2
    exit 2
fi
read -ra ssh <<<"${SSH:-ssh}"
torchrun=$(command -v torchrun) || { echo "error: no torchrun on PATH; activate your venv" >&2; exit 2; }

# NOTE: ssh starts a login shell with a fresh environment on the node: without these the workers run another
# Python (the node's PATH), bind gloo/NCCL to any interface and go online. Each goes as `env NAME=value`.
forwarded=()
for name in PATH VIRTUAL_ENV GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME NCCL_DEBUG HF_HOME HF_HUB_OFFLINE \
    HF_DATASETS_OFFLINE TRANSFORMERS_OFFLINE OMP_NUM_THREADS PYTHONUNBUFFERED ${FORWARD_ENV:-}; do
    if [[ -n ${!name+set} ]]; then forwarded+=("$name=${!name}"); fi
done

pids=()
stop_all() { kill -TERM "${pids[@]}" 2>/dev/null || true; }
# NOTE: killing our ssh clients closes their connections; with a terminal on the node (-tt) that hangs it up,
# and torchrun, on SIGHUP, stops its workers. Without -tt the remote torchruns would train on, orphaned.
trap 'echo "ssh_launch.sh: stopping all nodes" >&2; stop_all; wait; exit 130' INT TERM

for node_rank in "${!hosts[@]}"; do
    # NOTE: the remote side gets one command line that its shell splits again: quote every word (%q).
    remote=$(printf '%q ' cd "$PWD")"&& exec "$(printf '%q ' env "${forwarded[@]}" "$torchrun" \
        --nnodes "${#hosts[@]}" --nproc-per-node "$procs_per_node" --node-rank "$node_rank" \
        --master-addr "${hosts[0]}" --master-port "${MASTER_PORT:-29500}" "$@")
    # NOTE: stdin from /dev/null: the ssh clients must not fight over this terminal's input.
    "${ssh[@]}" -tt "${hosts[$node_rank]}" "$remote" </dev/null &
    pids+=($!)
done

# NOTE: the first node to fail stops the others; its peers would otherwise wait for it until a timeout.
status=0
for _ in "${pids[@]}"; do
    wait -n || { code=$?; ((status)) || status=$code; stop_all; }
done
exit "$status"
