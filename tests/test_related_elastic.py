"""related-topics/elastic-training: torchrun restarts the workers after a crash (--max-restarts) and takes in
a node that joins a running job (--nnodes=MIN:MAX); chapter 02's script resumes from its checkpoint each time.

tests/test_03_launchers.py::test_crashed_worker_is_restarted_from_the_checkpoint_within_the_job proves the
restart under Slurm on two nodes (job.sbatch). Here: the one-machine command `torchrun --standalone
--max-restarts=1`, compared bit for bit with an uninterrupted run; and a second node joining a one-node job.
Events come from tests/inject.py, which runs the chapter's script unchanged (its faults fire in the first
start of the workers only).
"""
import re
import time

import pytest

import launching
from conftest import (
    INJECT, Run, assert_same_training, inject_env, max_weight_diff, start_chapter, wait_or_fail,
)
from launching import read_metrics

# NOTE: torchrun (torch >= 2.5) keeps its rendezvous store across a restart, with the crashed workers' keys
# still in it, and the restarted workers fail to connect ("Connection refused"; pytorch/pytorch#135712).
# With this, rank 0 hosts a fresh store for every start (as job.sbatch does).
FRESH_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def start_torchrun(agent, args, tmp_path, env, experiment):
    """torchrun <agent flags> tests/inject.py <chapter 02's flags>, on one or (nproc 1 each) several agents."""
    nproc = 2 if "--standalone" in agent else 1
    process, _ = start_chapter("02", args, tmp_path, nproc=nproc, env={**FRESH_STORE, **env},
                               experiment=experiment, script=INJECT, agent=agent)
    return process


def metrics(exp_dir):
    return read_metrics(exp_dir / "metrics.jsonl")


@pytest.fixture
def reference(launch_once, common_args):
    """Chapter 02 on 2 ranks, uninterrupted (tests/test_02_ddp.py's run: 20 steps over two epochs, -b 32)."""
    return launch_once("02", [*common_args, "-b", 32, "--num-epochs", 2], nproc=2)


def test_a_killed_worker_is_restarted_and_the_job_ends_as_the_uninterrupted_run(reference, common_args,
                                                                                 tmp_path):
    """SIGKILL rank 1 after step 6, two steps after the checkpoint of step 4: torchrun stops rank 0, starts
    both again (attempt 1 of --max-restarts=1), they resume from step 4, and the job exits 0."""
    args = [*common_args, "-b", 32, "--num-epochs", 2, "--ckpt-freq", 4]
    kill = inject_env("02", "sigkill", rank=1, after_step=6)
    torchrun = start_torchrun(["--standalone", "--max-restarts=1"], args, tmp_path, kill, "killed")
    [(returncode, stdout, stderr)] = wait_or_fail([torchrun], 240, "torchrun")

    assert returncode == 0, stderr[-4000:]
    assert "inject: sigkill on rank 1 after step 6" in stderr
    # both ranks of the second start resumed from the newest checkpoint: steps 5 and 6 ran twice
    resumed = re.findall(r"rank (\d): resumed from \S+step-00000004 at step 4", stdout)
    assert sorted(resumed) == ["0", "1"], stdout
    exp_dir = tmp_path / "outputs" / "killed"
    # metrics.jsonl was cut back to step 4 on resume, so it reads as one clean run: the same world size doing
    # the same operations in the same order gives the uninterrupted run's losses to the bit, and its weights
    assert [m["step"] for m in metrics(exp_dir)] == list(range(1, 21))
    assert [m["loss"] for m in metrics(exp_dir)] == reference.losses
    assert max_weight_diff(exp_dir / "hf", reference.exp_dir / "hf") == 0


SCALE_STEPS = 60


def test_a_node_that_joins_restarts_every_worker_from_a_checkpoint_and_trains_the_same_global_batch(
    common_args, launch_once, tmp_path
):
    """Two torchrun agents with --nnodes=1:2 (two "nodes" on this machine, one process each). The first trains
    alone; when the second arrives, the first's agent sends its worker SIGTERM, chapter 02 checkpoints at that
    step and exits, and both agents start one worker each, which resume at world size 2. --global-batch-size 8
    at -b 4 makes 2 micro-batches a step alone, 1 on each of two ranks: the global batch, and so the training,
    do not change (a relaunch that changed it would stop with one line). --max-restarts=0: a membership change
    is not a failure."""
    launch = ["--nnodes=1:2", "--max-restarts=0", "--rdzv-backend=c10d",
              f"--rdzv-endpoint=localhost:{launching.free_port()}", "--rdzv-id=scale-up",
              # NOTE: the first agent waits this long for more nodes once it has its minimum (default 30 s)
              "--rdzv-conf=last_call_timeout=1"]
    args = [*common_args, "-b", 4, "--global-batch-size", 8, "--max-steps", SCALE_STEPS]
    env = inject_env("02", "slow-alone", after_step=2)
    exp_dir = tmp_path / "outputs" / "scale-up"
    first = start_torchrun(launch, args, tmp_path, env, "scale-up")
    deadline = time.monotonic() + 120
    while not metrics(exp_dir) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    second = start_torchrun(launch, args, tmp_path, env, "scale-up")
    results = wait_or_fail([first, second], 240, "torchrun")

    assert [r[0] for r in results] == [0, 0], "\n".join(r[2][-3000:] for r in results)
    stdout = "".join(r[1] for r in results)
    stderr = "".join(r[2] for r in results)
    assert "global batch: 8 sequences (1 ranks x -b 4 x 2 micro-batches)" in stdout
    assert "global batch: 8 sequences (2 ranks x -b 4 x 1 micro-batches)" in stdout
    stopped_at = int(re.search(r"stopped by a signal after step (\d+);", stderr)[1])
    assert 1 <= stopped_at < SCALE_STEPS
    # rank 1 exists only in the world of 2: both ranks resumed from the checkpoint the stop wrote
    resumed = re.findall(rf"rank (\d): resumed from \S+step-{stopped_at:08d} at step {stopped_at}\b", stdout)
    assert sorted(resumed) == ["0", "1"], stdout
    # One process at -b 8 trains the same global batches: the same numbers, to rounding.
    one_process = launch_once("01", [*common_args, "-b", 8, "--max-steps", SCALE_STEPS])
    joined = Run(0, stdout, stderr, exp_dir)
    assert_same_training(joined, one_process, SCALE_STEPS)
    print(f"one node for {stopped_at} steps, two nodes for {SCALE_STEPS - stopped_at}, one global batch of 8")
