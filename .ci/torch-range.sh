#!/bin/bash
# Both ends of the torch range the chapters support (TESTED_TORCH in every train_llm.py), each in a venv of its
# own: one loss-parity test of every chapter from 02 on (each technique's layout on 2-4 ranks, the mechanisms a
# torch release changes: DDP, FSDP2 and DCP, DTensor TP, pipelining, CP, EP), a DCP resume across world
# sizes, FSDP's fresh init (no warning on any rank), DCP's async save (its stager differs before 2.13), and
# chapter 09's clipping norm (torch 2.11 leaves some gradients Partial there).
# The pinned suite (.ci/run) runs all the rest once.
# PyPI's Linux torch is the CUDA build (about 4 GB with its nvidia packages); it runs on a CPU, where
# importing it takes twice as long as the CPU build's.
#     bash .ci/torch-range.sh oldest|newest
set -euo pipefail
cd "$(dirname "$0")/.."

case "$1" in
    # What common GPU containers ship (and the project's GPU check machine has).
    oldest) torch=2.11.0 transformers=5.17.0 ;;
    # The newest torch release pip resolves today; transformers as pinned.
    newest) torch=2.15.0 transformers=5.24.0 ;;
    *) echo "usage: bash .ci/torch-range.sh oldest|newest" >&2; exit 2 ;;
esac

venv=/tmp/ci-venv-torch-$torch
python3 -m venv --clear "$venv"
# PIP_CONSTRAINT=/dev/null replaces a machine-wide constraint file that may cap torch below the newest release.
PIP_CONSTRAINT=/dev/null "$venv/bin/pip" install --quiet "torch==$torch" "transformers==$transformers" \
    $(grep -vE '^(#|torch==|transformers==)' requirements.txt)
"$venv/bin/python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
"$venv/bin/python" -m pytest -p no:cacheprovider tests/test_torch_range.py \
    "tests/test_02_ddp.py::test_ddp_matches_single_process_on_the_global_batch[2]" \
    "tests/test_04_fsdp.py::test_resume_from_a_two_rank_checkpoint_continues_the_uninterrupted_run[4]" \
    tests/test_04_fsdp.py::test_fresh_init_matches_chapter_01s_init_and_recomputes_rope \
    "tests/test_05_405b.py::test_loss_matches_chapter_04_step_by_step[checkpointing-and-prefetch]" \
    tests/test_05_405b.py::test_async_checkpoints_train_and_save_bit_for_bit_what_synchronous_ones_do \
    "tests/test_06_tp.py::test_tp_matches_single_process_loss_and_weights[2]" \
    "tests/test_07_2d.py::test_2d_matches_single_process_at_the_global_batch[dp2-tp2-llama]" \
    "tests/test_08_pp.py::test_pipeline_matches_single_process[llama-interleaved-1f1b-2ranks]" \
    "tests/test_09_3d.py::test_3d_matches_single_process_at_the_global_batch[llama-pp2-dp1-tp2-interleaved-1f1b]" \
    tests/test_09_3d.py::test_replicated_weights_stay_bitwise_equal_across_tp_ranks_with_clipping_active \
    "tests/test_10_cp.py::test_context_parallel_matches_single_process[llama-dp2-cp2]" \
    "tests/test_11_ep.py::test_expert_parallel_matches_single_process[mixtral-dp2-ep2]"
