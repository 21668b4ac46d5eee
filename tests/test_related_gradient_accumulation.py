"""related-topics/gradient-accumulation: every chapter takes --grad-accum-steps (each chapter's tests prove K
micro-batches equal one K times larger batch); here, the recipe's two details on padded batches under DDP and
FSDP2 (check_accumulation.py: dividing by the global token count is right, by K is wrong), and a stopped
accumulating run on 2 ranks that resumes bit for bit.
"""
import json
import shutil
import sys

import torch
import transformers

import launching
from conftest import (
    INJECT, ROOT, inject_env, max_weight_diff, offline_env, record_launch, run_chapter, wait_or_fail,
)

TOPIC = ROOT / "related-topics" / "gradient-accumulation"
K = 4
STEPS = 20  # two epochs of 10 steps of 64 rows: the data order is reshuffled at step 11
STOP_AFTER = 9


def accumulated(launch_once, common_args, **kwargs):
    """Chapter 02 on 2 ranks, 4 micro-batches of 8 rows per rank and step: a global batch of 64."""
    return launch_once("02", [*common_args, "-b", 8, "--grad-accum-steps", K, "--num-epochs", 2], nproc=2,
                       **kwargs)


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


def test_a_stopped_accumulating_run_resumes_to_the_uninterrupted_losses_and_weights(launch_once, common_args,
                                                                                    tmp_path):
    """SIGTERM to rank 1 after optimizer step 9 (tests/inject.py counts optimizer steps, not micro-steps); the
    relaunch resumes at step 9, crosses the epoch boundary, and is bit for bit the uninterrupted run."""
    uninterrupted = accumulated(launch_once, common_args)
    interrupted = accumulated(launch_once, common_args, script=INJECT, expect_ok=False,
                              env=inject_env("02", "sigterm", rank=1, after_step=STOP_AFTER))
    assert interrupted.worker_stderr.count(f"stopped by a signal after step {STOP_AFTER};") == 2, (
        interrupted.stderr[-3000:]
    )
    state = json.loads((interrupted.exp_dir / "checkpoints" / f"step-{STOP_AFTER:08d}" / "state.json").read_text())
    # the data position counts rows of the global batch, micro-batches included: 9 steps x 64 rows
    assert (state["step"], state["epoch"], state["samples_in_epoch"]) == (STOP_AFTER, 0, STOP_AFTER * 64)

    shutil.copytree(interrupted.exp_dir, tmp_path / "outputs" / "test")
    resumed = run_chapter("02", [*common_args, "-b", 8, "--grad-accum-steps", K, "--num-epochs", 2], tmp_path,
                          nproc=2)
    assert resumed.stdout.count(f"at step {STOP_AFTER}") == 2
    assert resumed.losses == uninterrupted.losses
    assert [m["grad_norm"] for m in resumed.metrics] == [m["grad_norm"] for m in uninterrupted.metrics]
    assert max_weight_diff(resumed.exp_dir / "hf", uninterrupted.exp_dir / "hf") == 0


def test_zero_grad_accum_steps_fails_with_one_line(common_args, tmp_path):
    run = run_chapter("01", [*common_args, "--grad-accum-steps", 0], tmp_path, expect_ok=False, timeout=120)
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-1] == (
        "error: argument --grad-accum-steps: 0 is not a positive integer (--help lists the flags)"
    ) and "usage:" not in run.stderr, run.stderr[-3000:]
