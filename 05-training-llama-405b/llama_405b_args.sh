# The train_llm.py flags of the Llama 3.1 405B run, sourced by job.sbatch and ssh_launch.sh (one list, so the
# two launchers cannot drift apart; tests/test_05_405b.py parses every flag with train_llm.py's own parser).
# The layout and why: README.md ("The 405B layout"), checked by chapter 12's planner:
# python ../12-choosing-a-layout/plan.py --cpu-offload ...
#
# MODEL_DIR: the folder download_model.py filled (same path on every node); DATASET: a Hub id or local data.
model_dir=${MODEL_DIR:-/local/models/Llama-3.1-405B}
dataset=${DATASET:-roneneldan/TinyStories}
train_args=(
    -m "$model_dir" --from-pretrained -d "$dataset"
    # 1 sequence of 4096 tokens per GPU: 64 sequences (262k tokens) per step.
    -b 1 -s 4096 --dtype bfloat16 --lr 1e-5 --warmup-steps 100
    --cpu-offload --activation-checkpointing --explicit-prefetch
    --timeout-minutes 60
    # A checkpoint is 4.9 TB (fp32 weights and Adam moments): every 500 steps, not every 100, each written while
    # training goes on (76 GB a rank; a staging copy of 609 GB a node in CPU memory, see README.md).
    --ckpt-freq 500 --async-checkpoint --log-freq 1
)
