"""related-topics/determinism: two runs of chapter 02 on 2 ranks with the same seed are bitwise equal, also
when one of them is stopped and resumed; another seed trains differently; 1 rank and 2 ranks at the same global
batch agree only to rounding.

The runs use a tiny Llama with attention dropout 0.1 and fresh weights from --seed: every step draws random
dropout masks, so bitwise-equal losses need the same initial weights, the same data order and the same random
stream, also across a resume (the RNG state saved in each checkpoint). 14 steps of 64 rows cross the epoch
boundary after step 10 (64 of the 718 rows are held out for validation), where the data order is redrawn from
(seed, epoch 1).
"""
import shutil

import pytest
import torch

from conftest import INJECT, assert_same_training, inject_env, max_weight_diff, run_chapter, write_tiny_model

STEPS = 14
STOP_AFTER = 9


@pytest.fixture(scope="module")
def dropout_args(tmp_path_factory, tiny_dataset):
    model = write_tiny_model(tmp_path_factory.mktemp("tiny-llama-dropout"), attention_dropout=0.1)
    return ["-m", model, "-d", tiny_dataset, "-s", 32, "--dtype", "float32", "--log-freq", 1, "--warmup-steps", 2,
            "-b", 32, "--max-steps", STEPS, "--ckpt-freq", STOP_AFTER]


@pytest.fixture
def first_run(launch_once, dropout_args):
    return launch_once("02", [*dropout_args, "--seed", 0], nproc=2)


@pytest.fixture
def stopped_run(launch_once, dropout_args):
    """A second launch of the same command, stopped by SIGTERM to rank 1 after step 9: every rank stops there
    with a checkpoint (weights, AdamW state, schedule, data position, RNG state)."""
    run = launch_once("02", [*dropout_args, "--seed", 0], nproc=2, expect_ok=False, script=INJECT,
                      env=inject_env("02", "sigterm", rank=1, after_step=STOP_AFTER))
    assert run.worker_stderr.count(f"stopped by a signal after step {STOP_AFTER};") == 2, run.stderr[-3000:]
    return run


def checkpoint(run, step):
    return torch.load(run.exp_dir / "checkpoints" / f"step-{step:08d}" / "checkpoint.pt", weights_only=True)


def test_two_runs_with_the_same_seed_are_bitwise_equal(first_run, stopped_run):
    """The stopped launch is a second run of the same command up to step 9: same losses, and a checkpoint equal
    tensor for tensor (weights, AdamW moments, RNG state) to the one the first run wrote at that step."""
    assert len(first_run.losses) == STEPS and {m["epoch"] for m in first_run.metrics} == {0, 1}
    assert stopped_run.losses == first_run.losses[:STOP_AFTER]
    grad_norms = [m["grad_norm"] for m in first_run.metrics]
    assert [m["grad_norm"] for m in stopped_run.metrics] == grad_norms[:STOP_AFTER]
    ours, theirs = checkpoint(stopped_run, STOP_AFTER), checkpoint(first_run, STOP_AFTER)
    assert all(torch.equal(ours["model"][name], theirs["model"][name]) for name in theirs["model"])
    assert ours["optimizer"]["state"].keys() == theirs["optimizer"]["state"].keys()
    for index, state in theirs["optimizer"]["state"].items():
        assert all(torch.equal(ours["optimizer"]["state"][index][key], value) for key, value in state.items())
    assert torch.equal(ours["rng"]["cpu"], theirs["rng"]["cpu"])


def test_a_stopped_and_resumed_run_is_bitwise_the_uninterrupted_one(first_run, stopped_run, dropout_args,
                                                                     tmp_path):
    """The relaunch crosses the epoch boundary and must draw the dropout masks the uninterrupted run drew."""
    # dropout does draw random numbers in these steps: the generator moved on between the two checkpoints
    rng_at_stop, rng_at_end = (checkpoint(first_run, step)["rng"]["cpu"] for step in (STOP_AFTER, STEPS))
    assert not torch.equal(rng_at_stop, rng_at_end)
    shutil.copytree(stopped_run.exp_dir, tmp_path / "outputs" / "test")
    resumed = run_chapter("02", [*dropout_args, "--seed", 0], tmp_path, nproc=2)

    assert resumed.stdout.count(f"at step {STOP_AFTER}") == 2
    assert resumed.losses == first_run.losses
    assert [m["grad_norm"] for m in resumed.metrics] == [m["grad_norm"] for m in first_run.metrics]
    assert max_weight_diff(resumed.exp_dir / "hf", first_run.exp_dir / "hf") == 0


def test_another_seed_gives_other_weights_and_losses(first_run, launch_once, dropout_args):
    other = launch_once("02", [*dropout_args, "--seed", 1], nproc=2)

    # other initial weights, data order and dropout masks: the losses differ by far more than rounding
    assert max(abs(a - b) for a, b in zip(other.losses, first_run.losses)) > 1e-2, (other.losses, first_run.losses)
    assert max_weight_diff(other.exp_dir / "hf", first_run.exp_dir / "hf") > 1e-3


def test_one_rank_and_two_ranks_at_the_same_global_batch_agree_to_rounding_not_bitwise(launch_once, common_args):
    """Chapter 01 at -b 64 and chapter 02 on 2 ranks at -b 32, no dropout, 20 steps (tests/test_02_ddp.py's
    launches): the same samples, but 2 ranks sum the gradient in another order (two halves, then the
    all-reduce), so the numbers differ in the last bits and stay that close."""
    one = launch_once("01", [*common_args, "-b", 64, "--num-epochs", 2])
    two = launch_once("02", [*common_args, "-b", 32, "--num-epochs", 2], nproc=2)

    assert_same_training(two, one, 20)
    assert max_weight_diff(one.exp_dir / "hf", two.exp_dir / "hf") > 0, "expected rounding from the other order"
