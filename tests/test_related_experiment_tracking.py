"""related-topics/experiment-tracking: train_wandb_modes.py logs one training to wandb from rank 0 only, from
the first process of each node, or from every rank, and a relaunch continues the same runs.

Every launch runs offline (WANDB_MODE=offline): what each process logged is read back from the .wandb files it
wrote, the same records `wandb sync` uploads. The modes change who logs, never the training: every mode must
log the same global loss at every step, bit for bit (the same data, seeds and sums).
"""
import json
import subprocess

import pytest

import launching
from conftest import ROOT, offline_env, record_launch, wait_or_fail, wandb_records

SCRIPT = ROOT / "related-topics" / "experiment-tracking" / "train_wandb_modes.py"
STEPS = 6
FIRST_LAUNCH_STEPS = 3  # the resumed every-rank run stops here, then a relaunch trains on to STEPS


def launch(tmp_path, mode, steps, experiment, nnodes=1, nproc=2, timeout=180):
    """torchrun the script: one agent (--standalone), or `nnodes` agents on this machine meeting at a free
    port (c10d rendezvous), as `nnodes` nodes would. Fails the test on a hang or a non-zero exit."""
    args = ["--wandb-mode", mode, "--max-steps", steps, "--save-dir", tmp_path / "outputs", "-e", experiment]
    if nnodes == 1:
        agents = [("--standalone",)]
    else:
        agents = [("--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint",
                   f"localhost:{launching.free_port()}", "--rdzv-id", experiment)] * nnodes
    processes = [launching.start([*launching.command(SCRIPT, nproc, agent), *args], tmp_path, offline_env(tmp_path),
                                 stderr=subprocess.STDOUT) for agent in agents]
    results = wait_or_fail(processes, timeout, f"{mode} on {nnodes} x {nproc}")
    assert [code for code, _, _ in results] == [0] * nnodes, "\n".join(out[-3000:] for _, out, _ in results)
    if nnodes == 1:
        record_launch(SCRIPT, nproc, args)
    return tmp_path / "outputs" / experiment


def logged_runs(exp_dir):
    """{run id: [each launch's run, oldest first]}, a run being {"name", "group", "config", "history"}."""
    runs = {}
    for run_dir in sorted((exp_dir / "wandb").glob("offline-run-*")):
        run = {"history": []}
        for record in wandb_records(next(run_dir.glob("*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
                run.update(id=record.run.run_id, name=record.run.display_name, group=record.run.run_group,
                           config=config)
            elif kind == "history":
                # (wall-clock times, _runtime and _timestamp, are left out: they differ from launch to launch)
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                run["history"].append({key: value for key, value in row.items()
                                       if key not in ("_runtime", "_timestamp")})
        runs.setdefault(run["id"], []).append(run)
    return runs


def column(run, key):
    return [row[key] for row in run["history"]]


@pytest.fixture(scope="module")
def rank0(tmp_path_factory):
    return logged_runs(launch(tmp_path_factory.mktemp("rank0"), "rank0", STEPS, "rank0"))


@pytest.fixture(scope="module")
def every_rank(tmp_path_factory):
    """Two launches of one experiment: FIRST_LAUNCH_STEPS steps, then a relaunch to STEPS."""
    tmp_path = tmp_path_factory.mktemp("every-rank")
    launch(tmp_path, "every-rank", FIRST_LAUNCH_STEPS, "every-rank")
    return logged_runs(launch(tmp_path, "every-rank", STEPS, "every-rank"))


@pytest.fixture(scope="module")
def per_node(tmp_path_factory):
    """Two nodes (two torchrun agents on this machine) of two processes each: ranks 0, 1 and 2, 3."""
    return logged_runs(launch(tmp_path_factory.mktemp("per-node"), "per-node", STEPS, "per-node", nnodes=2))


def test_rank0_mode_logs_one_run_with_the_global_batch_loss(rank0, every_rank):
    assert list(rank0) == ["rank0"]
    [run] = rank0["rank0"]
    assert run["name"] == "rank0" and run["group"] == "" and run["config"]["rank"] == 0
    assert column(run, "_step") == list(range(1, STEPS + 1))
    assert set(run["history"][0]) == {"_step", "loss"}
    # the loss of the whole global batch: the mean of what the ranks computed on their slices
    first_launch = {run["id"]: run for runs in every_rank.values() for run in runs[:1]}
    local = [column(first_launch[f"every-rank-rank{rank}"], "local_loss") for rank in (0, 1)]
    for loss, a, b in zip(column(run, "loss"), *local):
        assert abs(loss - (a + b) / 2) < 1e-6  # float32 sums, here redone in float64


def test_every_rank_mode_logs_one_run_per_rank_in_one_group(every_rank, rank0):
    assert sorted(every_rank) == ["every-rank-rank0", "every-rank-rank1"]
    first_launch = [every_rank[f"every-rank-rank{rank}"][0] for rank in (0, 1)]
    for rank, run in enumerate(first_launch):
        assert run["name"] == f"rank{rank}" and run["group"] == "every-rank" and run["config"]["rank"] == rank
        assert column(run, "_step") == list(range(1, FIRST_LAUNCH_STEPS + 1))
        # every run holds the global loss, the same as rank 0 mode's: who logs changes nothing in the training
        assert column(run, "loss") == column(rank0["rank0"][0], "loss")[:FIRST_LAUNCH_STEPS]
    # and each its own rank's loss, on its own slice of the batch
    assert all(a != b for a, b in zip(*(column(run, "local_loss") for run in first_launch)))


def test_per_node_mode_logs_one_run_per_node_from_its_first_process(per_node, rank0):
    assert sorted(per_node) == ["per-node-node0", "per-node-node1"]
    runs = [per_node[f"per-node-node{node}"] for node in (0, 1)]
    assert [len(launches) for launches in runs] == [1, 1]
    for node, [run] in enumerate(runs):
        assert run["name"] == f"node{node}" and run["group"] == "per-node"
        # logged by the node's local rank 0: global rank 0 on node 0, 2 on node 1 (ranks 1 and 3 log nothing)
        assert run["config"]["rank"] == 2 * node and run["config"]["node"] == node
        assert column(run, "_step") == list(range(1, STEPS + 1))
    node_losses = [column(run, "node_loss") for [run] in runs]
    for step, (a, b) in enumerate(zip(*node_losses)):
        assert a != b
        # 4 ranks at -b 8 see other rows than 2 ranks do: the global loss is the mean of the two nodes' means
        assert abs((a + b) / 2 - column(runs[0][0], "loss")[step]) < 1e-6  # float32 sums, redone in float64


def test_a_relaunch_continues_the_same_runs_from_the_checkpoint(every_rank, rank0):
    for rank in (0, 1):
        first, second = every_rank[f"every-rank-rank{rank}"]
        # the same run id (id= + resume="allow"), logged by a second launch from the step after the checkpoint
        assert first["id"] == second["id"]
        assert second["name"] == f"rank{rank}" and second["group"] == "every-rank"
        assert column(second, "_step") == list(range(FIRST_LAUNCH_STEPS + 1, STEPS + 1))
        # and training went on exactly where it stopped: the two launches log the uninterrupted run's losses
        assert column(first, "loss") + column(second, "loss") == column(rank0["rank0"][0], "loss")
