"""related-topics/gradient-accumulation: K micro-batches of b sequences per rank train exactly as one batch of
K*b, on 1 rank and on 2; the loss divided by the global token count is what keeps that true when micro-batches
hold different numbers of tokens; a stopped run resumes to the same losses; a bad --grad-accum-steps fails
with one line.

The reference runs are the ones tests/test_02_ddp.py launches (chapter 01 at -b 64, chapter 02 on 2 ranks at
-b 32, both for two epochs of the tiny dataset), so launch_once shares them when the whole suite runs.
"""
import json
import shutil
import sys

import pytest
import torch
import transformers

import launching

from conftest import (
    INJECT, ROOT, assert_same_training, max_weight_diff, offline_env, record_launch, run_chapter, wait_or_fail,
)

TOPIC = ROOT / "related-topics" / "gradient-accumulation"
SCRIPT = TOPIC / "train_llm.py"
GLOBAL_BATCH = 64
K = 4
STEPS = 22  # two epochs of 11 steps of 64 rows: the data order is reshuffled at step 12
STOP_AFTER = 9
# NOTE: fp32 on CPU. Accumulating adds the K micro-batches' gradients in another order than one big batch's
# backward does, so numbers agree to rounding, far below what a wrong normalisation (loss divided by K twice,
# or not at all: 1e-1 and more) or a skipped sync (ranks drift apart) changes.


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


@pytest.mark.parametrize("nproc", [1, 2])
def test_accumulation_matches_a_k_times_larger_batch(launch_once, common_args, single_process,
                                                     ddp_k_times_larger, nproc):
    """1 rank: 4 micro-batches of 16 = chapter 01 at -b 64. 2 ranks: 4 micro-batches of 8 per rank = chapter 02
    at -b 32 per rank, and chapter 01 at -b 64."""
    ours = accumulated(launch_once, common_args, nproc)

    # the run trains (so agreeing numbers mean something): the loss falls well below its start
    assert ours.losses[-1] < ours.losses[0] - 0.5
    assert_same_training(ours, single_process, STEPS)
    if nproc == 2:
        assert_same_training(ours, ddp_k_times_larger, STEPS)


def one_batch_gradient(saved):
    """The gradient of the whole global batch's mean loss over its label tokens, computed here by a plain model
    from check_accumulation.py's starting weights and batch: not by the script under test."""
    config = transformers.LlamaConfig.from_dict(saved["config"])
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(saved["weights"])
    logits = model(input_ids=saved["input_ids"]).logits
    labels = saved["labels"]
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    (per_token[labels.flatten() != -100].sum() / (labels != -100).sum()).backward()
    return [p.grad for p in model.parameters()]


def test_dividing_by_the_global_token_count_is_right_and_by_k_is_wrong_when_token_counts_differ(tmp_path):
    """train_llm.py packs every row full, so its micro-batches all hold b x s label tokens and dividing by K
    would give the same numbers there. check_accumulation.py pads sequences of random lengths (labels -100), so
    micro-batches and ranks hold different token counts; its accumulated gradients, under DDP and FSDP2, are
    compared here with the whole batch's gradient from one pass of a plain model."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               TOPIC / "check_accumulation.py", "-b", "2", "-s", "32", "--max-steps", "1", "--save-dir", tmp_path]
    (returncode, _, stderr), = wait_or_fail([launching.start(command, tmp_path, offline_env(tmp_path))], 240,
                                            "check_accumulation.py")
    assert returncode == 0, stderr[-3000:]
    record_launch(command[5], 2, command[6:])
    results = json.loads((tmp_path / "check_accumulation.json").read_text())
    assert len(set(results["tokens_per_micro_batch"])) > 1, results  # the counts differ

    saved = torch.load(tmp_path / "check_accumulation.pt", weights_only=False)
    reference = one_batch_gradient(saved)
    scale = max(g.abs().max().item() for g in reference)
    difference = {run: max((g - r).abs().max().item() for g, r in zip(grads, reference)) / scale
                  for run, grads in saved["grads"].items()}
    assert len(difference) == 6, difference
    for wrapper in ("ddp", "fsdp"):
        # right: equal to rounding (measured 1e-7), whether gradients sync on the last micro-step or every one
        assert difference[f"{wrapper}, last micro-step, global tokens"] < 1e-5, difference
        assert difference[f"{wrapper}, every micro-step, global tokens"] < 1e-5, difference
        # wrong: each micro-batch's mean / K weighs a token of a short micro-batch more than one of a long one
        assert difference[f"{wrapper}, last micro-step, mean / K"] > 1e-2, difference


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
