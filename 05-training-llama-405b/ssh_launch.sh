#!/usr/bin/env bash
# Llama 3.1 405B on the 8 nodes of a hosts file, without a scheduler: chapter 03's ssh_launch.sh with this
# chapter's script and flags (llama_405b_args.sh), one process per GPU.
#
#   ./ssh_launch.sh hosts -e llama-405b              # hosts: one name a line, the head node first
#
# Arguments after the hosts file go to train_llm.py after the flags of llama_405b_args.sh (a later flag wins).
set -euo pipefail
(($# >= 1)) || { echo "usage: $0 HOSTS_FILE [train_llm.py flags...]" >&2; exit 2; }
hosts_file=$1
shift
here=$(cd "$(dirname "$0")" && pwd)
source "$here/llama_405b_args.sh"
exec "$here/../03-job-launchers/ssh_launch.sh" "$hosts_file" 8 "$here/train_llm.py" "${train_args[@]}" "$@"
