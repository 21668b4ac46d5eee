"""related-topics/gradient-accumulation: K micro-batches of b sequences per rank train exactly as one batch of
K*b, on 1 rank and on 2; the loss divided by the global token count is what keeps that true when micro-batches
hold different numbers of tokens; a stopped run resumes to the same losses; a bad --grad-accum-steps fails
with one line.

The reference runs are the ones tests/test_02_ddp.py launches (chapter 01 at -b 64, chapter 02 on 2 ranks at
-b 32, both for two epochs of the tiny dataset), so launch_once shares them when the whole suite runs.
"""
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from conftest import INJECT, ROOT, max_weight_diff, offline_env, record_launch, run_chapter

TOPIC = ROOT / "related-topics" / "gradient-accumulation"
SCRIPT = TOPIC / "train_llm.py"
GLOBAL_BATCH = 64
K = 4
STEPS = 22  # two epochs of 11 steps of 64 rows: the data order is reshuffled at step 12
STOP_AFTER = 9
# NOTE: fp32 on CPU. Accumulating adds the K micro-batches' gradients in another order than one big batch's
# backward does, so numbers agree to rounding (measured below 1e-6), far below what a wrong normalisation
# (loss divided by K twice, or not at all: 1e-1 and more) or a skipped sync (ranks drift apart) changes.
LOSS_TOLERANCE = 1e-5
WEIGHT_TOLERANCE = 1e-4


def two_epochs(batch_size, *flags):
    return ["-b", batch_size, *flags, "--num-epochs", 2]


@pytest.fixture
def single_process(launch_once, common_args):
    """Chapter 01 on the whole global batch of 64 (the same launch as tests/test_02_ddp.py's)."""
    return launch_once("01", [*common_args, *two_epochs(GLOBAL_BATCH)])


@pytest.fixture
def ddp_k_times_larger(launch_once, common_args):
    """Chapter 02 on 2 ranks at -b 32: one batch per rank K times larger than a micro-batch (test_02's launch)."""
    return launch_once("02", [*common_args, *two_epochs(GLOBAL_BATCH // 2)], nproc=2)


def accumulated(launch_once, common_args, nproc, script=SCRIPT, **kwargs):
    """This topic's script on nproc ranks, K micro-batches of 64 / (nproc * K) rows per rank and step."""
    batch_size = GLOBAL_BATCH // (nproc * K)
    return launch_once("02", [*common_args, *two_epochs(batch_size, "--grad-accum-steps", K)], nproc=nproc,
                       script=script, **kwargs)


def assert_same_training(ours, reference, what):
    assert [m["step"] for m in ours.metrics] == [m["step"] for m in reference.metrics] == list(range(1, STEPS + 1))
    loss_difference = max(abs(a - b) for a, b in zip(ours.losses, reference.losses))
    weight_difference = max_weight_diff(ours.exp_dir / "hf", reference.exp_dir / "hf")
    print(f"{what}: loss {loss_difference:.1e}, weights {weight_difference:.1e}")
    for mine, theirs in zip(ours.metrics, reference.metrics):
        assert abs(mine["loss"] - theirs["loss"]) < LOSS_TOLERANCE, (mine, theirs)
        # A gradient scaled by K or by the world size can hide in the loss while clipping is active, not here.
        assert abs(mine["grad_norm"] - theirs["grad_norm"]) < 1e-4 * theirs["grad_norm"], (mine, theirs)
        assert mine["lr"] == theirs["lr"]
    assert weight_difference < WEIGHT_TOLERANCE


@pytest.mark.parametrize("nproc", [1, 2])
def test_accumulation_matches_a_k_times_larger_batch(launch_once, common_args, single_process,
                                                     ddp_k_times_larger, nproc):
    """1 rank: 4 micro-batches of 16 = chapter 01 at -b 64. 2 ranks: 4 micro-batches of 8 per rank = chapter 02
    at -b 32 per rank, and chapter 01 at -b 64."""
    ours = accumulated(launch_once, common_args, nproc)

    # the run trains (so agreeing numbers mean something): the loss falls well below its start
    assert ours.losses[-1] < ours.losses[0] - 0.5
    assert_same_training(ours, single_process, f"{nproc} rank(s) x {K} micro-batches vs chapter 01")
    if nproc == 2:
        assert_same_training(ours, ddp_k_times_larger, f"2 ranks x {K} micro-batches vs chapter 02")


def test_dividing_by_the_global_token_count_is_right_and_by_k_is_wrong_when_token_counts_differ(tmp_path):
    """train_llm.py packs every row full, so its micro-batches all hold b x s label tokens and dividing by K
    would give the same numbers there. check_accumulation.py pads sequences of random lengths (labels -100), so
    micro-batches and ranks hold different token counts, and compares the accumulated gradient with the one
    of the whole batch's mean loss, computed by one plain model in one pass, under DDP and FSDP2."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               TOPIC / "check_accumulation.py", "-b", "2", "-s", "32", "--max-steps", "1", "--save-dir", tmp_path]
    process = subprocess.Popen(command, cwd=tmp_path, env=offline_env(tmp_path), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"check_accumulation.py hung for 240 s\n{process.communicate()[1][-3000:]}")
    assert process.returncode == 0, stderr[-3000:]
    record_launch(command[5], 2, command[6:])
    results = json.loads((tmp_path / "check_accumulation.json").read_text())

    assert len(set(results["tokens_per_micro_batch"])) > 1, results  # the counts differ
    runs = {(run["wrapper"], run["sync"], run["normalisation"]): run["max_relative_grad_difference"]
            for run in results["runs"]}
    assert len(runs) == 6, runs
    for wrapper in ("ddp", "fsdp"):
        # right: equal to rounding, whether the gradients sync on the last micro-step only or on every one
        assert runs[wrapper, "last micro-step", "global tokens"] < 1e-5, runs
        assert runs[wrapper, "every micro-step", "global tokens"] < 1e-5, runs
        # wrong: each micro-batch's mean / K weighs a token of a short micro-batch more than one of a long one
        assert runs[wrapper, "last micro-step", "mean / K"] > 1e-2, runs


def inject_sigterm(after_step, rank=1):
    return {"INJECT_SCRIPT": str(SCRIPT), "INJECT": "sigterm", "INJECT_RANK": str(rank),
            "INJECT_AFTER_STEP": str(after_step)}


def test_a_stopped_run_resumes_to_the_uninterrupted_losses_and_weights(launch_once, common_args, tmp_path):
    """SIGTERM to rank 1 after optimizer step 9 (tests/inject.py counts optimizer steps, not micro-steps);
    the relaunch resumes at step 9, crosses the epoch boundary, and is bit for bit the uninterrupted run."""
    uninterrupted = accumulated(launch_once, common_args, 2)
    interrupted = accumulated(launch_once, common_args, 2, script=INJECT, env=inject_sigterm(STOP_AFTER),
                              expect_ok=False)
    assert interrupted.worker_stderr.count(f"stopped by a signal after step {STOP_AFTER};") == 2, (
        interrupted.stderr[-3000:]
    )
    state = json.loads((interrupted.exp_dir / "checkpoints" / f"step-{STOP_AFTER:08d}" / "state.json").read_text())
    # the data position counts rows of the global batch, micro-batches included: 9 steps x 64 rows
    assert (state["step"], state["epoch"], state["samples_in_epoch"]) == (STOP_AFTER, 0, STOP_AFTER * GLOBAL_BATCH)

    shutil.copytree(interrupted.exp_dir, tmp_path / "outputs" / "test")
    resumed = run_chapter("02", [*common_args, *two_epochs(GLOBAL_BATCH // (2 * K), "--grad-accum-steps", K)],
                          tmp_path, nproc=2, script=SCRIPT)
    assert resumed.stdout.count(f"at step {STOP_AFTER}") == 2
    assert resumed.losses == uninterrupted.losses
    assert [m["grad_norm"] for m in resumed.metrics] == [m["grad_norm"] for m in uninterrupted.metrics]
    assert max_weight_diff(resumed.exp_dir / "hf", uninterrupted.exp_dir / "hf") == 0


def test_zero_grad_accum_steps_fails_with_one_line(common_args, tmp_path):
    run = run_chapter("02", [*common_args, "--grad-accum-steps", 0], tmp_path, script=SCRIPT, expect_ok=False,
                      timeout=120)
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-1].endswith(
        "train_llm.py: error: argument --grad-accum-steps: 0 is not a positive integer"
    ), run.stderr[-3000:]
