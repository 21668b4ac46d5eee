"""Start a script the way a reader does and stop it with everything it started: the one launcher of the tests
and the tools (tests/gpu_check.py, tests/stress_exit.py). Plain Python, no pytest: the GPU check imports it on
a machine that runs no tests.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def command(script, nproc=None):
    """`python script` (nproc None), or `torchrun --standalone --nproc_per_node=nproc script`: --standalone
    picks a free port for the rendezvous, so launches side by side never collide."""
    if nproc is None:
        return [sys.executable, str(script)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script)]


def start(argv, cwd, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE):
    """Popen in a session of its own (a Ctrl-C at the terminal reaches the test runner, not the launch)."""
    return subprocess.Popen([str(arg) for arg in argv], cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=True,
                            start_new_session=True)


def descendants(pid):
    """Every process below pid, children first. torchrun starts its workers in sessions of their own, so a
    process-group kill of torchrun misses them (and the kernel then sends them SIGTERM, on which the chapters
    save a checkpoint before they exit)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command name (field 2) may hold spaces and parentheses: the fields after its last ")" are fixed.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def kill_tree(process):
    """SIGKILL a launch and every process it started (the tree is read first: orphans would be re-parented)."""
    for pid in [process.pid, *descendants(process.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait(process, timeout, until=None, poll_s=0.5):
    """Wait for a launch to exit, at most `timeout` seconds, or until `until()` is true (then it is killed).
    Returns (stdout, stderr, how): how is "exited", "timed out" or "until". Output is drained while waiting, so a
    chatty launch never blocks on a full pipe."""
    deadline = time.monotonic() + timeout
    how = "exited"
    while True:
        left = deadline - time.monotonic()
        try:
            stdout, stderr = process.communicate(timeout=max(0.01, min(poll_s, left)) if until else max(0.01, left))
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
