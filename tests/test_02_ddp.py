"""Chapter 02 (DDP): trains the same model to the same numbers as chapter 01, resumes exactly (also on another
world size), stops cleanly on SIGTERM, and fails fast and loudly when one rank fails.

The reference is chapter 01 on the whole global batch of 64 sequences; DDP runs on N ranks use -b 64/N.
The tiny dataset packs into 718 rows of 33 tokens; 64 (one global batch, the least) are held out for the
validation loss, so one epoch is 10 steps of 64 and two epochs (20 steps) cross an epoch boundary, where the
data order is reshuffled.
"""
import contextlib
import hashlib
import http.server
import json
import os
import re
import shutil
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from conftest import (
    INJECT, assert_same_training, inject_env, max_weight_diff, measured, online_env, run_chapter,
    start_chapter, wandb_history, worker_stderr,
)
import launching
from launching import without_timing

GLOBAL_BATCH = 64
STEPS = 20  # two epochs of 10 steps
STOP_AFTER = 9  # the interrupted run stops here; its resume crosses the epoch boundary after step 10


def two_epochs(batch_size):
    return ["-b", batch_size, "--num-epochs", 2]


@pytest.fixture
def single_process(launch_once, common_args):
    return launch_once("01", [*common_args, *two_epochs(GLOBAL_BATCH)])


@pytest.fixture
def ddp_two_ranks(launch_once, common_args):
    return launch_once("02", [*common_args, *two_epochs(GLOBAL_BATCH // 2)], nproc=2)


@pytest.mark.parametrize("nproc", [2, 4])
def test_ddp_matches_single_process_on_the_global_batch(launch_once, common_args, single_process, nproc):
    ddp = launch_once("02", [*common_args, *two_epochs(GLOBAL_BATCH // nproc)], nproc=nproc)

    assert {m["epoch"] for m in ddp.metrics} == {0, 1}
    # the run trains (so agreeing numbers mean something): the loss falls well below its start
    assert single_process.losses[-1] < single_process.losses[0] - 0.5
    # (fp32: N ranks sum gradients in another order than one process does, so numbers agree to rounding)
    assert_same_training(ddp, single_process, STEPS)


def test_k_micro_batches_per_rank_train_as_one_batch_and_ddp_all_reduces_once_a_step(launch_once, common_args,
                                                                                      single_process):
    """2 ranks x -b 8 x 4 micro-batches: chapter 01's global batch of 64 at every step, and DDP's gradient
    all-reduce runs once a step (no_sync on the first 3 micro-batches), counted through a comm hook."""
    accumulated = launch_once("02", [*common_args, *two_epochs(8), "--grad-accum-steps", 4], nproc=2,
                              script=INJECT, env=inject_env("02", "ddp-all-reduces"))
    assert_same_training(accumulated, single_process, STEPS)
    for rank in (0, 1):
        by_step = json.loads(re.search(rf"^rank {rank}: ddp_all_reduces (.*)$", accumulated.stdout, re.M)[1])
        # the tiny model's gradients fit DDP's first bucket: one all-reduce, where 4 micro-batches without
        # no_sync would make 4
        assert by_step == {str(step): 1 for step in range(1, STEPS + 1)}, by_step


@pytest.fixture
def interrupted(launch_once, common_args):
    """Two ranks, SIGTERM delivered to rank 1 only, right after its optimizer step STOP_AFTER."""
    return launch_once("02", [*common_args, *two_epochs(GLOBAL_BATCH // 2)], nproc=2, expect_ok=False,
                       script=INJECT, env=inject_env("02", "sigterm", rank=1, after_step=STOP_AFTER))


def test_sigterm_on_one_rank_stops_all_ranks_at_that_step_with_a_checkpoint(interrupted, ddp_two_ranks):
    assert interrupted.returncode != 0
    # every rank stopped after the same step (the signal reached rank 1 only; MAX over ranks spread it)
    assert interrupted.worker_stderr.count(f"stopped by a signal after step {STOP_AFTER};") == 2, interrupted.stderr[-3000:]
    assert sorted(os.listdir(interrupted.exp_dir / "checkpoints")) == [f"step-{STOP_AFTER:08d}"]
    assert [m["step"] for m in interrupted.metrics] == list(range(1, STOP_AFTER + 1))
    assert interrupted.losses == ddp_two_ranks.losses[:STOP_AFTER]
    assert not (interrupted.exp_dir / "hf").exists()


@pytest.mark.parametrize("nproc", [2, 1])
def test_resume_continues_the_uninterrupted_run(interrupted, ddp_two_ranks, common_args, tmp_path, nproc):
    """Resume on the same world size, and on one rank with -b doubled (same global batch of 64)."""
    shutil.copytree(interrupted.exp_dir, tmp_path / "outputs" / "test")
    resumed = run_chapter("02", [*common_args, *two_epochs(GLOBAL_BATCH // nproc)], tmp_path, nproc=nproc)

    assert resumed.stdout.count("resumed from") == nproc
    assert f"at step {STOP_AFTER}" in resumed.stdout
    assert [m["step"] for m in resumed.metrics] == list(range(1, STEPS + 1))
    if nproc == 2:
        # NOTE: same world size, same operations in the same order: the resumed run is bit-for-bit the
        # uninterrupted one (model, optimizer, schedule and data position all restored).
        assert resumed.losses == ddp_two_ranks.losses
        assert max_weight_diff(resumed.exp_dir / "hf", ddp_two_ranks.exp_dir / "hf") == 0
    else:
        # one rank sums the 64 sequences in another order than two ranks do: equal to rounding
        assert_same_training(resumed, ddp_two_ranks, STEPS)


@contextlib.contextmanager
def background_job(tmp_path, args, wait_for_steps=3):
    """Chapter 02 on 2 ranks with torchrun in the background, yielded once it has logged wait_for_steps steps;
    whatever is left of it (launcher and workers) is killed on the way out."""
    process, _ = start_chapter("02", args, tmp_path, nproc=2)
    metrics = tmp_path / "outputs" / "test" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 180
        while len(launching.read_metrics(metrics)) < wait_for_steps:
            assert process.poll() is None and time.monotonic() < deadline, "the job ended or hung before training"
            time.sleep(0.05)
        yield process
    finally:
        launching.kill_tree(process)


def finish(process, timeout=120):
    stdout, stderr, how = launching.wait(process, timeout)
    assert how == "exited", f"the job did not end within {timeout} s\n{stderr[-3000:]}"
    return process.returncode, stdout, stderr


# A long run: 4 sequences a step, 177 steps (8 of the 718 rows held out), time enough to act in the middle.
LONG = ["-b", 2]


def test_sigterm_to_the_whole_job_stops_every_rank_at_one_step_and_a_relaunch_finishes(common_args, tmp_path):
    """What a scheduler does: SIGTERM to torchrun and its workers while they train, at a step we do not choose."""
    args = [*common_args, *LONG]
    with background_job(tmp_path, args) as job:
        for pid in [job.pid, *launching.children(job.pid)]:
            os.kill(pid, signal.SIGTERM)
        returncode, _, stderr = finish(job)

    assert returncode != 0
    stop_steps = re.findall(r"stopped by a signal after step (\d+);", worker_stderr(stderr))
    assert len(stop_steps) == 2 and len(set(stop_steps)) == 1, stderr[-3000:]
    stop_step = int(stop_steps[0])
    assert 3 <= stop_step < 177
    exp_dir = tmp_path / "outputs" / "test"
    assert os.listdir(exp_dir / "checkpoints") == [f"step-{stop_step:08d}"]

    relaunched = run_chapter("02", args, tmp_path, nproc=2)
    assert relaunched.stdout.count(f"at step {stop_step}") == 2
    assert [m["step"] for m in relaunched.metrics] == list(range(1, 178))


def test_ctrl_c_stops_with_a_checkpoint_and_one_line_per_rank(common_args, tmp_path):
    """Ctrl-C in a terminal sends SIGINT to torchrun, which passes it on to its workers."""
    with background_job(tmp_path, [*common_args, *LONG]) as job:
        os.kill(job.pid, signal.SIGINT)
        returncode, _, stderr = finish(job)

    assert returncode != 0
    stop_steps = re.findall(r"stopped by a signal after step (\d+); relaunch the same command to resume\n",
                            worker_stderr(stderr))
    assert len(stop_steps) == 2 and len(set(stop_steps)) == 1, stderr[-3000:]
    assert os.listdir(tmp_path / "outputs" / "test" / "checkpoints") == [f"step-{int(stop_steps[0]):08d}"]
    # torchrun prints a traceback of its own (SignalException, see the README); no worker prints one.
    assert 'train_llm.py", line' not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]


def test_workers_stop_within_seconds_when_torchrun_is_killed(common_args, tmp_path):
    """kill -9 of torchrun alone (the OOM killer, a user): its workers must not train on as orphans."""
    with background_job(tmp_path, [*common_args, *LONG]) as job:
        workers = launching.children(job.pid)
        assert len(workers) == 2
        os.kill(job.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while any(Path(f"/proc/{pid}").exists() and "Z" not in process_state(pid) for pid in workers):
            assert time.monotonic() - killed_at < 10, "workers still running 10 s after torchrun was killed"
            time.sleep(0.1)
    # They stopped the way a signal stops them: at one step, with a checkpoint.
    assert len(os.listdir(tmp_path / "outputs" / "test" / "checkpoints")) == 1


def process_state(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_failing_rank_stops_the_job_fast_and_torchrun_reports_its_rank_and_cause(common_args, tmp_path):
    failed = run_chapter("02", [*common_args, "-b", 8], tmp_path, nproc=2, expect_ok=False, script=INJECT,
                         env=inject_env("02", "raise", rank=1, after_step=2))
    ended = time.time()

    assert failed.returncode != 0
    injected_at = float(re.search(r"inject: raise on rank 1 after step 2 at ([\d.]+)", failed.stderr)[1])
    # NOTE: without torchrun tearing the job down, rank 0 would wait in its next all-reduce for the process
    # group timeout (30 minutes by default on gloo, 10 on nccl). torchrun polls its workers every 0.1 s.
    assert ended - injected_at < 60
    # torchrun's summary lists every failed rank with the traceback @record wrote. Its "Root Cause" is the
    # earliest in whole seconds, so it may be rank 0's "Connection closed by peer" (a tie goes to the lowest
    # rank): the test, like the README, looks for rank 1's own entry.
    entries = re.split(r"\n\s*\[\d+\]:\n", failed.stderr[failed.stderr.index("Failures:"):])
    rank_1 = [entry for entry in entries if re.search(r"rank\s*: 1 \(local_rank: 1\)", entry)]
    assert len(rank_1) == 1 and "RuntimeError: injected failure on rank 1 after step 2" in rank_1[0], entries


def test_without_torchrun_it_says_how_to_launch(common_args, tmp_path):
    run = run_chapter("02", common_args, tmp_path, expect_ok=False)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == (
        "error: launch this script with torchrun, e.g. torchrun --nproc_per_node=2 train_llm.py"
    )


def test_ranks_agree_on_a_stop_at_log_steps_without_a_collective_every_step(common_args, launch_once):
    """Agreeing on the stop flag every step would make every step wait for the GPU (.item()); it rides on the
    all-reduce of the losses at log steps instead, and a signal to one rank still stops all after one step."""
    counted = launch_once("02", [*common_args, "-b", 8, "--max-steps", 10, "--log-freq", 5], nproc=2,
                          script=INJECT, env=inject_env("02", "count-collectives"))
    for rank in (0, 1):
        by_step = json.loads(re.search(rf"^rank {rank}: collectives (.*)$", counted.stdout, re.MULTILINE)[1])
        # Any collective of the script's own (a barrier, a broadcast, an all-reduce) after steps 1-4 or 6-9
        # would make every step wait; step 0 is the setup (data, checkpoint search).
        assert sorted(int(step) for step in by_step) == [0, 5, 10], by_step
        assert by_step["5"] == ["all_reduce"]
        # The last step: the all-reduces of its log line and of its validation loss, then the checkpoint's object
        # collectives, and no all-reduce of losses for the checkpoint (a checkpoint step logs: none are pending).
        assert by_step["10"][:2] == ["all_reduce", "all_reduce"], by_step
        assert "all_reduce" not in by_step["10"][2:], by_step

    stopped = launch_once("02", [*common_args, "-b", 8, "--max-steps", 15, "--log-freq", 5], nproc=2,
                          expect_ok=False, script=INJECT, env=inject_env("02", "sigterm", rank=1, after_step=7))
    assert stopped.worker_stderr.count("stopped by a signal after step 10;") == 2, stopped.stderr[-3000:]
    assert [m["step"] for m in stopped.metrics] == [5, 10]


def test_resumed_metrics_equal_the_uninterrupted_ones_line_for_line(common_args, launch_once, tmp_path):
    """A checkpoint at step 3 falls between the log steps of --log-freq 4: it logs steps 1-3 itself, so the
    resumed run's step-4 line averages step 4 alone, as the uninterrupted run's does."""
    args = [*common_args, "-b", 8, "--max-steps", 8, "--log-freq", 4, "--ckpt-freq", 3, "--eval-freq", 1000]
    uninterrupted = launch_once("02", args, nproc=2)
    assert [m["step"] for m in uninterrupted.metrics] == [3, 4, 6, 8]
    crashed = run_chapter("02", args, tmp_path, nproc=2, expect_ok=False, script=INJECT,
                          env=inject_env("02", "raise", rank=1, after_step=5))
    assert crashed.returncode != 0 and os.listdir(crashed.exp_dir / "checkpoints") == ["step-00000003"]

    resumed = run_chapter("02", args, tmp_path, nproc=2)
    assert "at step 3" in resumed.stdout
    assert without_timing(resumed.metrics) == without_timing(uninterrupted.metrics)


def checksums(folder):
    return {path: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.rglob("*")) if path.is_file()}


def broken_parquet(path):
    path.write_bytes(b"PAR1" + os.urandom(200) + b"PAR1")


# name: (how to make the bad file, the message every rank must print)
# Rank 0 loads the data and sends its error line to the others (rank_0_first), whatever the error: empty and
# binary files, whose lines chapter 01's test_bad_input_fails_fast_with_one_line checks, go the same way.
BAD_DATA = {
    "jsonl-without-text": (lambda path: path.with_suffix(".jsonl").write_text('{"body": "a"}\n' * 50),
                           "has no 'text' column (it has ['body'])"),
    "broken-parquet": (lambda path: broken_parquet(path.with_suffix(".parquet")), "cannot load dataset"),
    "unknown-extension": (lambda path: path.with_suffix(".xml").write_text("<a/>"), "use a .txt, .json"),
}


@pytest.mark.parametrize("case", BAD_DATA)
def test_bad_data_gives_every_rank_the_same_line_and_leaves_checkpoints_alone(case, ddp_two_ranks, tmp_path):
    make, message = BAD_DATA[case]
    make(tmp_path / "data")
    data_file = next(tmp_path.glob("data.*"))
    shutil.copytree(ddp_two_ranks.exp_dir, tmp_path / "outputs" / "test")
    before = checksums(tmp_path / "outputs" / "test" / "checkpoints")

    with measured() as cost:
        run = run_chapter("02", ["-d", data_file, "-s", 32, "--dtype", "float32"], tmp_path, nproc=2,
                          expect_ok=False)
    # NOTE: torchrun and two ranks that fail right after their imports: ~15 CPU seconds; a rank left waiting for
    # the other in a collective would take the process group's timeout.
    assert run.returncode != 0 and cost["cpu"] < 60 and cost["wall"] < 240, cost
    lines = re.findall(rf"error: [^\n]*{re.escape(message)}[^\n]*", run.worker_stderr)
    assert len(lines) == 2 and lines[0] == lines[1], run.stderr[-3000:]
    # No traceback from the script on any rank (torchrun prints one of its own, ChildFailedError)...
    assert 'train_llm.py", line' not in run.stderr and "gloo" not in run.stderr, run.stderr[-3000:]
    # ...and its summary names the real cause, not "Connection closed by peer"
    assert lines[0] in run.stderr[run.stderr.index("Root Cause"):]
    assert checksums(tmp_path / "outputs" / "test" / "checkpoints") == before


@pytest.fixture
def default_run_with_wandb(launch_once):
    """The reader's default on 2 ranks, logging every step to an offline wandb run."""
    return launch_once("02", ["--max-steps", 3, "--log-freq", 1, "--wandb"], nproc=2)


def test_only_rank_0_shows_the_tokenize_progress_bar(default_run_with_wandb):
    """With the built-in corpus (no datasets cache) every rank tokenizes; only rank 0 says so."""
    assert default_run_with_wandb.stderr.count("tokenize and pack into rows of 129:   0%") == 1


def test_rank_0_alone_logs_every_metric_line_to_wandb(default_run_with_wandb):
    runs = list((default_run_with_wandb.exp_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    logged = wandb_history(runs[0])
    assert [m["step"] for m in default_run_with_wandb.metrics] == [1, 2, 3]
    assert len(logged) == 3
    assert [{key: row[key] for key in line} for row, line in zip(logged, default_run_with_wandb.metrics)] == (
        default_run_with_wandb.metrics
    )


@pytest.fixture(scope="module")
def hub():
    """A stand-in for the Hugging Face Hub on a local port (HF_ENDPOINT) that has nothing: it answers every
    request as the Hub does for a name it does not have, 404 with a token and 401 "RepoNotFound" without."""
    class Hub(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404 if self.headers.get("Authorization") else 401)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(b'{"error": "Repository not found"}')

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def closed_port():
    """A local port that refuses connections: bound (so that no launch takes it meanwhile), never listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


NO_HUB = "http://127.0.0.1:{closed_port}"  # connection refused at once
# A reader's first mistakes under torchrun: flags, the Hub (HF_ENDPOINT; "hub": the stand-in), extra
# environment, the line each rank must print.
FIRST_MISTAKES = {
    "zero-batch": (["-b", 0], NO_HUB, {}, "argument -b/--batch-size: 0 is not a positive integer"),
    "mistyped-data-file": (["-d", "data/trian.txt"], NO_HUB, {},
                           "argument -d/--dataset-name: no such file or folder: 'data/trian.txt'"),
    "missing-model-folder": (["-m", "./my-llama"], NO_HUB, {},
                             "argument -m/--model-name: no such file or folder: './my-llama'"),
    # A name without ./ is a folder or a Hub id: the libraries look it up and say what they found.
    "model-not-on-the-hub": (["-m", "my-llama"], "hub", {},
                             "error: cannot load model 'my-llama' (my-llama is not a local folder and is not a "
                             "valid model identifier"),
    "dataset-not-on-the-hub": (["-d", "owner/stories"], "hub", {"HF_TOKEN": "hf_test"},
                               "error: cannot load dataset 'owner/stories' (Dataset 'owner/stories' doesn't exist "
                               "on the Hub"),
}


@pytest.mark.parametrize("case", FIRST_MISTAKES)
def test_a_first_mistake_is_one_line_on_every_rank_and_in_torchruns_summary(case, hub, closed_port, tmp_path):
    flags, endpoint, env, message = FIRST_MISTAKES[case]
    endpoint = hub if endpoint == "hub" else endpoint.format(closed_port=closed_port)
    with measured() as cost:
        run = run_chapter("02", flags, tmp_path, nproc=2, expect_ok=False, timeout=60,
                          env=online_env(HF_ENDPOINT=endpoint, **env))
    # Idle, each case takes 4-6 s; a Hub that does not answer would add the libraries' retries (25 s). Wall
    # time also grows with the machine's load (15 s measured beside a CI run), so the CPU bound catches real
    # work and the wall bound, twice the 15 s asked for, retries.
    assert cost["cpu"] < 20 and cost["wall"] < 30, cost
    assert run.returncode == 1
    message = message.format(closed_port=closed_port)
    lines = [line for line in run.worker_stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 2 and len(set(lines)) == 1 and message in lines[0], run.stderr[-3000:]
    assert "usage:" not in run.stderr and 'train_llm.py", line' not in run.stderr, run.stderr[-3000:]
    # torchrun's summary shows the line as the root cause (not "To enable traceback see", nor SIGTERM)
    root_cause = run.stderr[run.stderr.index("Root Cause"):]
    assert f"traceback : {lines[0]}" in root_cause, root_cause
    assert not (tmp_path / "outputs").exists()
