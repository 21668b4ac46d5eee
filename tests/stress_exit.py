"""Launch a chapter many times under CPU load and count how its processes exit.

    python tests/stress_exit.py --chapter 02 --nproc 2 --launches 50

A distributed script can finish its work and still fail at exit: a hang while process-group threads are torn
down, or a crash (SIGABRT, "terminate called without an active exception") after everything was written.
Such failures show up in a few launches out of dozens, and mostly when the CPU is busy, so this script keeps
every core busy with spinning processes while it launches the chapter's tiny default run (--max-steps 3)
again and again, each with a timeout. It prints one summary line and exits 1 unless every launch exited 0.
Not collected by pytest (a single launch is cheap; fifty are not): tests/test_stress_exit.py runs it for two.
"""
import argparse
import collections
import datetime
import multiprocessing
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import launching  # noqa: E402
from conftest import CHAPTERS, offline_env  # noqa: E402


def spin():
    while True:
        pass


def launch(script, nproc, extra_args, tmp_path, timeout):
    """One torchrun launch; returns (outcome, seconds, output tail). Outcome: ok, hang, sigabrt, exit N."""
    args = ["--save-dir", tmp_path / "outputs", "--max-steps", 3, *extra_args]
    started = time.monotonic()
    process = launching.start([*launching.command(script, nproc), *args], tmp_path, offline_env(tmp_path),
                              stderr=subprocess.STDOUT)
    output, _, how = launching.wait(process, timeout)
    seconds = time.monotonic() - started
    if how == "timed out":
        return "hang", seconds, output[-3000:]
    if process.returncode == 0:
        return "ok", seconds, ""
    # NOTE: torchrun itself exits 1 when a worker dies by a signal; its report says which signal.
    if "SIGABRT" in output or process.returncode == -signal.SIGABRT:
        return "sigabrt", seconds, output[-3000:]
    return f"exit {process.returncode}", seconds, output[-3000:]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chapter", required=True, choices=sorted(CHAPTERS))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--launches", type=int, default=50)
    parser.add_argument("--timeout", type=float, default=180, help="seconds before a launch counts as a hang")
    parser.add_argument("--spinners", type=int, default=max(1, os.cpu_count() - 1),
                        help="busy-looping processes that keep the CPU busy (default: all cores but one)")
    parser.add_argument("--extra-args", default="", help="more flags for train_llm.py, e.g. '--compile'")
    parser.add_argument("--script", type=Path, default=None,
                        help="launch this file instead of the chapter's train_llm.py (e.g. a variant without a fix)")
    args = parser.parse_args()

    script = (args.script or CHAPTERS[args.chapter] / "train_llm.py").resolve()
    # NOTE: a SIGTERM (e.g. from `timeout`) must still run the finally below, or the spinners keep spinning.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.spinners)]
    for spinner in spinners:
        spinner.start()
    outcomes, durations = collections.Counter(), []
    started = time.monotonic()
    try:
        for index in range(args.launches):
            with tempfile.TemporaryDirectory(prefix="stress-exit-") as tmp:
                outcome, seconds, tail = launch(script, args.nproc, args.extra_args.split(), Path(tmp), args.timeout)
            outcomes[outcome] += 1
            durations.append(seconds)
            print(f"launch {index + 1}/{args.launches}: {outcome} in {seconds:.1f} s", flush=True)
            if outcome != "ok":
                print(tail, flush=True)
    finally:
        for spinner in spinners:
            spinner.terminate()
            spinner.join()
    wall = time.monotonic() - started
    failures = args.launches - outcomes["ok"]
    print(
        f"{script.relative_to(script.parents[1])}, {args.nproc} ranks, {args.launches} launches under {args.spinners} spinning "
        f"processes: {failures} failed ({dict(outcomes)}), wall {wall:.0f} s, "
        f"launch {min(durations):.1f}-{max(durations):.1f} s, {datetime.date.today()}, "
        f"{os.cpu_count()}-core {platform.machine()}, torch {torch_version()}"
    )
    sys.exit(1 if failures else 0)


def torch_version():
    import torch

    return torch.__version__


if __name__ == "__main__":
    main()
