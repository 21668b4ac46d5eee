"""Chapter 09: pipeline x FSDP2 x tensor parallelism on a (pp, dp, tp) mesh trains the same model to the same
numbers as chapter 01 on one process at the global batch (dp * -b): at (pp, dp, tp) = (2, 1, 2) for a Granite
(a Llama that scales outside its layers), (2, 2, 1) for a Qwen3 whose embedding is tied to its head, and
(2, 1, 2) for a Llama under the interleaved schedule, also compiled on 2 ranks; a run stopped by SIGTERM
resumes to the uninterrupted losses, also on another layout; the weights that TP replicates stay equal bit for
bit under clipping; sizes whose product is not the number of ranks fail with one line.

Numbers agree to the rounding tolerances of tests/conftest.py (fp32 on CPU).
"""

import json
import re

import pytest

from conftest import (
    INJECT, assert_same_training, assert_tied_copies_equal, inject_env, load_weights, run_chapter,
    stop_then_resume,
)

GLOBAL_BATCH = 8
STEPS = 10
STOP_AFTER = 4
# (model, pp, dp, tp, schedule). Granite is a Llama that scales its embeddings and logits outside the layers,
# which the hidden states sent between stages (here sequence slices of DTensors) must skip.
LAYOUTS = [("granite", 2, 1, 2, "1f1b"), ("qwen3-tied", 2, 2, 1, "1f1b"), ("llama", 2, 1, 2, "interleaved-1f1b")]


def on(pp, dp, tp, schedule="1f1b"):
    """Flags and process count for a layout: -b keeps the global batch at GLOBAL_BATCH."""
    return ["-b", GLOBAL_BATCH // dp, "--pp", pp, "--dp", dp, "--tp", tp, "--schedule", schedule], pp * dp * tp


@pytest.fixture
def launch(launch_once, common_args, four_layer_models):
    """A STEPS-step run, shared across tests (chapter 01's with tests/test_08_pp.py): chapter 01 (layout None)
    at -b GLOBAL_BATCH, or chapter 09 on a layout."""

    def launch_layout(model, layout=None):
        args = [*common_args, "-m", four_layer_models[model], "--max-steps", STEPS]
        if layout is None:
            return launch_once("01", [*args, "-b", GLOBAL_BATCH])
        flags, nproc = on(*layout)
        return launch_once("09", [*args, *flags], nproc=nproc)

    return launch_layout


@pytest.mark.parametrize("model,pp,dp,tp,schedule", LAYOUTS,
                         ids=[f"{m}-pp{pp}-dp{dp}-tp{tp}-{s}" for m, pp, dp, tp, s in LAYOUTS])
def test_3d_matches_single_process_at_the_global_batch(launch, model, pp, dp, tp, schedule):
    single_process = launch(model)
    assert single_process.losses[-1] < single_process.losses[0] - 0.5
    assert min(m["grad_norm"] for m in single_process.metrics) > 1.5
    ours = launch(model, (pp, dp, tp, schedule))
    assert_same_training(ours, single_process, STEPS)
    if model == "qwen3-tied":
        assert_tied_copies_equal(ours)
        assert "lm_head.weight" not in load_weights(ours.exp_dir / "hf")  # written once, as HF writes it


def test_the_schedule_keeps_no_micro_batch_outputs_after_a_step(common_args, four_layer_models, tmp_path):
    # As in chapter 08: by default the last stage would keep every micro-batch's logits after the step.
    flags, nproc = on(2, 1, 1)
    args = [*common_args, "-m", four_layer_models["llama"], "--max-steps", 2, *flags]
    run = run_chapter("09", args, tmp_path, nproc=nproc, script=INJECT, env=inject_env("09", "kept-outputs"))
    for rank in range(nproc):
        assert f"rank {rank}: kept_output_chunks 0 in 1 stages" in run.stdout, run.stdout[-2000:]

def test_compile_trains_as_single_process_does(launch, launch_once, common_args, four_layer_models):
    """--compile compiles each block of each stage, as chapter 07 does: on 2 pipeline ranks, whose blocks still
    hold FSDP's and TP's DTensors (on meshes of one rank); chapters 06 and 07 compile TP and FSDP on more."""
    flags, nproc = on(2, 1, 1)
    args = [*common_args, "-m", four_layer_models["llama"], "--max-steps", STEPS, *flags, "--compile"]
    assert_same_training(launch_once("09", args, nproc=nproc), launch("llama"), STEPS)


def test_sigterm_then_relaunch_on_the_same_and_on_another_layout_continues_the_uninterrupted_run(
    launch, common_args, four_layer_models, tmp_path
):
    layout = ("qwen3-tied", 2, 2, 1, "1f1b")
    uninterrupted = launch(layout[0], layout[1:])
    args = [*common_args, "-m", four_layer_models["qwen3-tied"], "--max-steps", STEPS]
    flags, nproc = on(*layout[1:])
    # (pp 2, dp 1, tp 2) at -b 8: the same global batch, each stage's weights split by TP instead of FSDP. DCP
    # stores each piece under the whole model's name and offsets, so the checkpoint reshards on load.
    other_flags, other_nproc = on(2, 1, 2)
    for run in stop_then_resume("09", [*args, *flags], nproc, tmp_path, STOP_AFTER,
                                elsewhere=([*args, *other_flags], other_nproc)):
        assert_same_training(run, uninterrupted, STEPS, first_step=STOP_AFTER + 1)


def test_replicated_weights_stay_bitwise_equal_across_tp_ranks_with_clipping_active(common_args, four_layer_models,
                                                                                      tmp_path):
    """Every rank computes the clipping norm with one all-reduce, so each clips by the same bits: the norm weights
    that tensor parallelism replicates stay equal bit for bit after 20 clipped steps. torch's own full_tensor()
    sums over tp, then dp, warning that ranks may then disagree."""
    flags, nproc = on(2, 1, 2)
    args = [*common_args, "-m", four_layer_models["llama"], "--max-steps", 20, *flags, "--max-grad-norm", 0.01]
    run = run_chapter("09", args, tmp_path, nproc=nproc, script=INJECT, env=inject_env("09", "replica-hashes"))
    assert min(m["grad_norm"] for m in run.metrics) > 0.1  # every step clipped
    hashes = [json.loads(re.search(rf"^rank {rank}: replica_hashes (.*)$", run.stdout, re.M)[1])
              for rank in range(nproc)]
    for stage_ranks in [(0, 1), (2, 3)]:  # the tp pairs of pipeline stages 0 and 1
        first, second = (hashes[rank] for rank in stage_ranks)
        replicated = [i for i, param in enumerate(first) if "tp" in param["replicated_over"]]
        assert replicated, first
        assert [first[i]["hash"] for i in replicated] == [second[i]["hash"] for i in replicated]
    assert "_NormPartial" not in run.stderr


@pytest.mark.parametrize("flags,message", [
    (["--pp", 2, "--dp", 2], "error: --pp 2 x --dp 2 x --tp 1 = 4 ranks, but 2 were launched; launch that many "
                             "processes, or pass --dp 1"),
    (["--pp", 2, "--tp", 2], "error: --pp 2 x --tp 2 = 4 does not divide the 2 ranks; pass sizes whose product "
                             "divides them (a TP group must stay inside one node)"),
], ids=["dp", "pp-tp"])
def test_sizes_that_do_not_make_the_ranks_fail_with_one_line_on_every_rank(common_args, tmp_path, flags, message):
    run = run_chapter("09", [*common_args, *flags], tmp_path, nproc=2, expect_ok=False, timeout=60)
    assert run.returncode != 0
    assert run.worker_stderr.count(message) == 2, run.stderr[-3000:]
    assert 'train_llm.py", line' not in run.stderr  # no traceback from the script
    assert not (run.exp_dir / "checkpoints").exists()
