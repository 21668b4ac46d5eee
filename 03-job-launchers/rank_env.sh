#!/usr/bin/env bash
# Run a command with the variables torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE), taken from the
# launcher that started this process: mpirun (OMPI_COMM_WORLD_*) or srun without torchrun (SLURM_*).
#
#   mpirun -np 4 --host node0:2,node1:2 -x MASTER_ADDR=node0 -x MASTER_PORT=29500 ./rank_env.sh python train_llm.py
#   MASTER_ADDR=node0 MASTER_PORT=29500 srun --ntasks-per-node=2 ./rank_env.sh python train_llm.py
#
# MASTER_ADDR and MASTER_PORT name the process that hosts the store every rank meets at (rank 0's node and a
# free port there); they come from the launch command, since neither launcher knows them.
set -euo pipefail
if [[ -n ${OMPI_COMM_WORLD_RANK:-} ]]; then
    export RANK=$OMPI_COMM_WORLD_RANK LOCAL_RANK=$OMPI_COMM_WORLD_LOCAL_RANK WORLD_SIZE=$OMPI_COMM_WORLD_SIZE
elif [[ -n ${SLURM_PROCID:-} && -n ${SLURM_STEP_ID:-} ]]; then
    export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS
else
    echo "error: rank_env.sh found neither OMPI_COMM_WORLD_RANK (mpirun) nor SLURM_PROCID (srun); start it with one of them" >&2
    exit 1
fi
if [[ -z ${MASTER_ADDR:-} || -z ${MASTER_PORT:-} ]]; then
    echo "error: set MASTER_ADDR and MASTER_PORT (rank 0's node and a free port), e.g. mpirun -x MASTER_ADDR=node0 -x MASTER_PORT=29500" >&2
    exit 1
fi
exec "$@"
