"""Chapter 07: FSDP2 over dp x tensor parallelism over tp trains the same model to the same numbers as chapter 01
on one process at the global batch (dp * -b), for a Llama on (dp, tp) = (2, 2), (1, 2) and (2, 1) and a Qwen3
(per-head norms) on (2, 2), from pretrained and from fresh weights, in fp32 and (to bf16 rounding) in bf16;
each rank holds 1/(dp * tp) of every matrix and of its Adam state; a run stopped by SIGTERM resumes to the
uninterrupted losses, also on another layout; a --tp that does not divide the ranks fails with one line.

The ranks sum partial results in another order than one process does: numbers agree to the rounding tolerances
of tests/conftest.py, far below what a real bug (a wrong slice of the batch, a missing reduce-scatter, Adam's
state lost on resume) changes.
"""
import pytest

from conftest import (
    INJECT, assert_same_training, inject_env, load_weights, mean_weight_diff, run_chapter, shard_bytes,
    stop_then_resume, write_tiny_model,
)

GLOBAL_BATCH = 8
STEPS = 10
STOP_AFTER = 4
LAYOUTS = [(2, 2), (1, 2), (2, 1)]  # (dp, tp)


def on(dp, tp):
    """Flags and process count for a layout: -b keeps the global batch at GLOBAL_BATCH."""
    return ["-b", GLOBAL_BATCH // dp, "--tp", tp], dp * tp


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), architecture="qwen3")


@pytest.fixture
def model_path(request, tiny_model, qwen3_model):
    return {"llama": tiny_model, "qwen3": qwen3_model}[request.param]


@pytest.fixture
def launch(launch_once, common_args):
    """A STEPS-step run, shared across tests: chapter 01 (layout None) at -b GLOBAL_BATCH, or chapter 07 on
    (dp, tp) through tests/inject.py, which prints what each rank holds after step 1 (shard_bytes)."""

    def launch_layout(model, layout=None):
        args = [*common_args, "-m", model, "--max-steps", STEPS]
        if layout is None:
            return launch_once("01", [*args, "-b", GLOBAL_BATCH])
        flags, nproc = on(*layout)
        return launch_once("07", [*args, *flags], nproc=nproc, script=INJECT, env=inject_env("07", "shard-bytes"))

    return launch_layout


# The Qwen3 differs from the Llama in what tensor parallelism splits (per-head norms): it runs where TP does.
PARITY = [*(("llama", layout) for layout in LAYOUTS), ("qwen3", (2, 2))]


@pytest.mark.parametrize("model_path,layout", PARITY, indirect=["model_path"],
                         ids=[f"dp{dp}-tp{tp}-{model}" for model, (dp, tp) in PARITY])
def test_2d_matches_single_process_at_the_global_batch(launch, model_path, layout):
    single_process = launch(model_path)
    # the run trains (so agreeing numbers mean something): the loss falls well below its start
    assert single_process.losses[-1] < single_process.losses[0] - 0.5
    # clipping is active (--max-grad-norm 1), so a norm that missed a dimension would change the updates
    assert min(m["grad_norm"] for m in single_process.metrics) > 1.5
    assert_same_training(launch(model_path, layout), single_process, STEPS)


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"dp{dp}-tp{tp}" for dp, tp in LAYOUTS])
def test_each_rank_holds_its_share_of_weights_gradients_and_optimizer_state(launch, tiny_model, layout):
    dp, tp = layout
    by_rank = shard_bytes(launch(tiny_model, layout))
    assert sorted(by_rank) == list(range(dp * tp))

    tensors = load_weights(tiny_model)
    model_bytes = 4 * sum(t.numel() for t in tensors.values())  # fp32
    # NOTE: TP keeps the norm weights whole on every rank of a TP group (sequence parallelism runs them on
    # all tokens of its slice); only FSDP splits them, over dp. Every matrix is split over both.
    norm_bytes = 4 * sum(t.numel() for name, t in tensors.items() if "norm" in name)
    expected = (model_bytes - norm_bytes) // (dp * tp) + norm_bytes // dp
    # NOTE: Adam keeps a step counter per parameter, a 4-byte scalar every rank holds whole.
    step_counters = 4 * len(tensors)
    for rank, held in by_rank.items():
        assert held["parameters"][1] == held["gradients"][1] == model_bytes
        assert held["optimizer_state"][1] == 2 * model_bytes + step_counters  # Adam's two moments + counters
        # NOTE: every dimension of the tiny model divides by 2 and 4, so no shard needs padding.
        assert held["parameters"][0] == held["gradients"][0] == expected, (rank, held)
        assert held["optimizer_state"][0] == 2 * expected + step_counters, (rank, held)
    # the norms are a small part of the model: each rank holds about 1/(dp * tp) of it
    assert expected <= model_bytes / (dp * tp) * 1.02


def test_sigterm_then_relaunch_on_the_same_and_on_another_layout_continues_the_uninterrupted_run(
    launch, tiny_model, common_args, tmp_path
):
    uninterrupted = launch(tiny_model, (2, 2))
    args = [*common_args, "-m", tiny_model, "--max-steps", STEPS]
    flags, nproc = on(2, 2)
    # The same layout, and (dp 1, tp 2) at -b 8: the same global batch on half the ranks. DCP stores where each
    # piece sits in the full tensor, so the (dp 2, tp 2) checkpoint reshards on load.
    other_flags, other_nproc = on(1, 2)
    for run in stop_then_resume("07", [*args, *flags], nproc, tmp_path, STOP_AFTER,
                                elsewhere=([*args, *other_flags], other_nproc)):
        # Steps after the relaunch equal the uninterrupted run's: AdamW's moments were restored (chapter 06
        # measured that losing them shifts step 6 by 0.036).
        assert_same_training(run, uninterrupted, STEPS, first_step=STOP_AFTER + 1)


def test_fresh_init_equals_single_process_init_and_keeps_a_tied_embedding_tied(tiny_dataset, tmp_path):
    """From fresh weights (no --from-pretrained) on a model wide enough for per-tensor statistics, with the
    embedding tied to the output head (as in Llama 3.2 1B)."""
    model = write_tiny_model(tmp_path / "wide", hidden_size=256, intermediate_size=512, tie_word_embeddings=True)
    # NOTE: 3 steps move each weight by at most 3 * lr = 3e-3, little against the init's std of 0.02, and enough
    # to separate a tied embedding from an untied one (each would get different updates).
    args = ["-m", model, "-d", tiny_dataset, "-s", 32, "--dtype", "float32", "--log-freq", 1, "--max-steps", 3,
            "--warmup-steps", 1]
    single = run_chapter("01", [*args, "-b", GLOBAL_BATCH], tmp_path, experiment="single")
    flags, nproc = on(2, 2)
    ours = run_chapter("07", [*args, *flags], tmp_path, nproc=nproc, experiment="2d")
    # every rank builds chapter 01's model from the same seed, then keeps its pieces: the same weights
    assert_same_training(ours, single, 3)
    # HF writes a tied matrix once; a separate head would mean that TP or FSDP untied them.
    assert "lm_head.weight" not in load_weights(ours.exp_dir / "hf")


def test_bf16_mixed_precision_computes_in_bf16_and_follows_single_process_autocast(
    launch, launch_once, common_args, tiny_model
):
    """--dtype bfloat16: chapter 01 runs under autocast; chapter 07 under FSDP's MixedPrecisionPolicy (bf16
    weights in every op, gradients reduced in fp32), so the numbers agree only to bf16 rounding."""
    args = [*common_args, "--max-steps", STEPS, "--dtype", "bfloat16"]
    single = launch_once("01", [*args, "-b", GLOBAL_BATCH])
    flags, nproc = on(2, 2)
    ours = launch_once("07", [*args, *flags], nproc=nproc)
    fp32 = launch(tiny_model, (2, 2))
    # NOTE: measured: 1.5e-3 from our own fp32 run (so bf16 is in effect), 1.6e-3 from chapter 01's bf16
    # autocast (which keeps the norms' weights in fp32; the policy casts them too).
    assert max(abs(a - b) for a, b in zip(ours.losses, fp32.losses)) > 5e-4, (ours.losses, fp32.losses)
    assert max(abs(a - b) for a, b in zip(single.losses, ours.losses)) < 5e-3, (single.losses, ours.losses)
    # A weight's bf16 rounding can reach the size of what training moved it (1.4e-3 of at most 6.5e-3), but it
    # averages out over all weights: 1.5e-5 apart on average, measured 2026-12-03, where training moved them
    # 3.3e-3. The bound is 3x that; chapter 07 skipping its last optimizer step puts them 6.5e-5 apart.
    assert mean_weight_diff(single.exp_dir / "hf", ours.exp_dir / "hf") < 4.5e-5


def test_compile_trains_as_single_process_does(launch, launch_once, common_args, tiny_model):
    """--compile compiles each block: compiling the whole model under FSDP and TP fails in dynamo (torch 2.13).
    At (dp, tp) = (2, 1) the blocks hold FSDP's sharded DTensors on a TP mesh of one rank; tensor parallelism
    alone under --compile is chapter 06's test."""
    flags, nproc = on(2, 1)
    args = [*common_args, "-m", tiny_model, "--max-steps", STEPS, *flags, "--compile"]
    ours = launch_once("07", args, nproc=nproc)
    assert_same_training(ours, launch(tiny_model), STEPS)


def test_tp_that_does_not_divide_the_ranks_fails_with_one_line_on_every_rank(tiny_model, common_args, tmp_path):
    run = run_chapter("07", [*common_args, "--tp", 4], tmp_path, nproc=2, expect_ok=False)
    assert run.returncode != 0
    message = ("error: --tp 4 does not divide the 2 ranks; pass a divisor of the processes per node (a TP group "
               "must stay inside one node)")
    assert run.worker_stderr.count(message) == 2, run.stderr[-3000:]
    assert not (run.exp_dir / "checkpoints").exists()
