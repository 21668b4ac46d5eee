"""Print the Python stack of every training process of a running job, on this machine or on every node.

    python tools/dump_stacks.py                            # every rank running on this machine
    python tools/dump_stacks.py --pid 4242                 # only those started by process 4242 (torchrun)
    python tools/dump_stacks.py --hosts node0 node1 --job my-run   # each node, over ssh: torchrun --rdzv-id my-run
    python tools/dump_stacks.py --slurm-job 1234           # each node of a running Slurm job

py-spy reads each process's stack from outside, pausing it for milliseconds: the job needs no flag, no restart,
no code. It needs the right to read another process's memory: root, or the same user where ptrace is allowed
(sysctl kernel.yama.ptrace_scope=0; in a container, --cap-add SYS_PTRACE). Over ssh or srun it runs from the
same paths as here, so install it in the job's environment (pip install py-spy).
"""
import argparse
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from jobs import run_on_nodes, training_processes


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", nargs="+", default=[], help="run on these hosts over ssh")
    parser.add_argument("--ssh", default="ssh", help="the ssh command, e.g. 'ssh -F my-config'")
    parser.add_argument("--slurm-job", help="run on every node of this running Slurm job, for its processes")
    parser.add_argument("--job", help="only processes of this torchrun --rdzv-id or Slurm job id")
    parser.add_argument("--pid", type=int, help="only processes started by this one (on this machine)")
    parser.add_argument("--native", action="store_true", help="also show C/C++ frames (py-spy dump --native)")
    args = parser.parse_args()
    job = args.job or args.slurm_job
    if not args.hosts and args.slurm_job is None:
        print(dump_local(job, args.pid, args.native), end="")
        return
    command = [sys.executable, Path(__file__).resolve(), *(["--job", job] if job else []),
               *(["--native"] if args.native else [])]
    for node, code, output in run_on_nodes(command, args.hosts, args.ssh, args.slurm_job):
        print(output.rstrip() + "\n" if code == 0 else f"=== {node}: failed (exit {code})\n{output}")


def dump_local(job=None, ancestor=None, native=False):
    """The stacks of this machine's training processes, lowest rank first, each under a header line."""
    venv_bin = Path(sys.executable).parent
    py_spy = shutil.which("py-spy", path=f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}")
    if py_spy is None:
        sys.exit("error: py-spy not found; pip install py-spy (see diagnosing-errors/requirements.txt)")
    host = socket.gethostname()
    processes = training_processes(job, ancestor)
    if not processes:
        return f"=== {host}: no training process (none with RANK and LOCAL_RANK in its environment)\n"
    pids = {process["pid"] for process in processes}
    text = ""
    for process in processes:
        dump = subprocess.run([py_spy, "dump", "--pid", str(process["pid"]), *(["--native"] if native else [])],
                              capture_output=True, text=True, timeout=30)
        # NOTE: a rank's own children (DataLoader workers) inherit its RANK: say whose they are.
        child = f", child of pid {process['ppid']}" if process["ppid"] in pids else ""
        text += (f"=== {host} rank {process['rank']} (local rank {process['local_rank']}) pid {process['pid']}"
                 f"{child}\n{dump.stdout.strip() or dump.stderr.strip()}\n\n")
    return text


if __name__ == "__main__":
    main()
