"""The practice cluster's own life cycle (03-job-launchers/practice-cluster): a cluster whose processes all died
without down.sh (a killed session, a restored machine snapshot) leaves its bridge and network namespaces in the
kernel, and the next up.sh must clear them, not fail; while a cluster still runs, up.sh must refuse and leave it
running. A module of its own: conftest's `cluster` fixture keeps one cluster up for a whole module.
"""
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

from conftest import CLUSTER_FILES, PRACTICE, practice_cluster_state_dir, worker_unit

NODES = ("node0", "node1")


def up(state):
    return subprocess.run([PRACTICE / "up.sh", state], capture_output=True, text=True, timeout=120)


def down(state):
    subprocess.run([PRACTICE / "down.sh", state], capture_output=True, timeout=120)
    shutil.rmtree(state, ignore_errors=True)


def kill_everything_of(state):
    """SIGKILL a cluster's daemons and whatever runs in its nodes, as a killed session would: no down.sh."""
    pids = {int(pid_file.read_text()) for pid_file in state.glob("*.pid")}
    for node in NODES:
        pids |= {int(pid) for pid in subprocess.run(["ip", "netns", "pids", node], capture_output=True,
                                                     text=True).stdout.split()}
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_up_refuses_while_a_cluster_runs_and_clears_one_whose_processes_died():
    first, second = practice_cluster_state_dir(), practice_cluster_state_dir()
    try:
        started = up(first)
        assert started.returncode == 0, started.stdout + started.stderr

        refused = up(second)
        assert refused.returncode != 0
        assert f"a practice cluster still runs on br-tut (state in {first})" in refused.stderr
        assert subprocess.run(["sinfo", "-h"], env={**os.environ, "SLURM_CONF": str(first / "slurm.conf")},
                              capture_output=True).returncode == 0, "the refusal must leave the cluster running"

        kill_everything_of(first)
        cleared = up(second)
        assert cleared.returncode == 0, cleared.stdout + cleared.stderr
        assert f"removing a practice cluster left behind with nothing running (state in {first})" in cleared.stderr
        assert "practice cluster up" in cleared.stdout
    finally:
        down(second)
        down(first)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert "br-tut" not in links and not any(Path("/run/netns", node).exists() for node in NODES)


def test_every_file_that_brings_up_a_cluster_runs_on_one_worker_after_the_other():
    """Two clusters at once on one machine collide (fixed node names): every test file that brings one up (the
    `cluster` fixture or practice_cluster_state_dir) is in one pytest-xdist worker unit (worker_unit)."""
    users = {path.name for path in Path(__file__).parent.glob("test_*.py")
             if re.search(r"[(,]\s*cluster\s*[,)]|practice_cluster_state_dir\(", path.read_text())}
    assert users == CLUSTER_FILES
    assert {worker_unit(f"tests/{name}::test_something") for name in users} == {"practice cluster"}
    readme_command = "tests/test_docs.py::test_readme_command_runs[README.md: python x.py]"
    assert worker_unit(readme_command) == "README commands: README.md"
