"""Start a script the way a reader does and stop it with everything it started: the one launcher of the tests
and the tools (tests/gpu_check.py, tests/stress_exit.py), and the readers of what a launch leaves behind. Plain
Python, no pytest: the GPU check imports it on a machine that runs no tests.
"""
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def command(script, nproc=None, agent=("--standalone",)):
    """`python script` (nproc None), or `torchrun <agent> --nproc_per_node=nproc script`. The default agent,
    --standalone, picks a free port for its rendezvous, so launches side by side never collide; pass other
    flags (--nnodes, --rdzv-endpoint, --max-restarts, ...) for several agents or restarts."""
    if nproc is None:
        return [sys.executable, str(script)]
    return [sys.executable, "-m", "torch.distributed.run", *map(str, agent), f"--nproc_per_node={nproc}",
            str(script)]


def start(argv, cwd, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE):
    """Popen in a session of its own (a Ctrl-C at the terminal reaches the test runner, not the launch)."""
    return subprocess.Popen([str(arg) for arg in argv], cwd=cwd, env=env, stdout=stdout, stderr=stderr,
                            text=True, start_new_session=True)


def children_by_parent():
    """{pid: [its children's pids]} of every process now."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command name (field 2) may hold spaces and parentheses: the fields after its last ")" are fixed.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return children


def children(pid):
    """The processes pid started (torchrun's: its workers)."""
    return children_by_parent().get(pid, [])


def descendants(pid):
    """Every process below pid, children first. torchrun starts its workers in sessions of their own, so a
    process-group kill of torchrun misses them (and the kernel then sends them SIGTERM, on which the chapters
    save a checkpoint before they exit)."""
    tree = children_by_parent()
    found, queue = [], [pid]
    while queue:
        for child in tree.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def kill_tree(process):
    """SIGKILL a launch and every process it started (the tree is read first: orphans would be re-parented),
    then reap it."""
    for pid in [process.pid, *descendants(process.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def wait(process, timeout, until=None, poll_s=0.5):
    """Wait for a launch to exit, at most `timeout` seconds, or until `until()` is true (then it is killed).
    Returns (stdout, stderr, how): how is "exited", "timed out" or "until". Output is drained while waiting, so a
    chatty launch never blocks on a full pipe."""
    deadline = time.monotonic() + timeout
    how = "exited"
    while True:
        left = deadline - time.monotonic()
        try:
            stdout, stderr = process.communicate(timeout=max(0.01, min(poll_s, left) if until else left))
            break
        except subprocess.TimeoutExpired:
            if until is not None and until():
                how = "until"
            elif time.monotonic() < deadline:
                continue
            else:
                how = "timed out"
            kill_tree(process)
            stdout, stderr = process.communicate()
            break
        except KeyboardInterrupt:
            kill_tree(process)
            raise
    return stdout or "", stderr or "", how


def wait_all(processes, timeout):
    """wait() for launches that run together, with one deadline: [(stdout, stderr, how)] in their order. Once
    one times out, every one still running is killed (a job of several agents cannot finish without it)."""
    deadline = time.monotonic() + timeout
    results = []
    for process in processes:
        results.append(wait(process, max(0.0, deadline - time.monotonic())))
        if results[-1][2] == "timed out":
            for other in processes:
                if other.poll() is None:
                    kill_tree(other)
    return results


def read_metrics(path):
    """The lines of a metrics.jsonl as dicts, [] if it does not exist yet; only complete lines, so a file that a
    running launch is still writing can be read."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True)
            if line.endswith("\n") and line.strip()]


def without_timing(metrics):
    """Metrics lines without what depends on the machine's speed and load (tokens/s, MFU, peak memory)."""
    return [{key: value for key, value in line.items() if key not in ("tokens_per_s", "mfu", "peak_memory_gb")}
            for line in metrics]


def free_port():
    """A TCP port nothing listens on now (for agents that must meet at a port known in advance)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def load_script(path):
    """A script's top-level names (functions, constants) without running its __main__ block."""
    return runpy.run_path(str(path))
