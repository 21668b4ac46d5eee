"""Where a job's processes are: the training processes on this machine, and one command run on every node.

Shared by dump_stacks.py and monitor.py. To cover several nodes, each tool runs itself on every node (over ssh
or with srun) and collects what each node printed. That assumes what a multi-node job already needs: the same
paths on every node (a shared filesystem), so this machine's Python and this folder exist there too.
"""
import os
import shlex
import subprocess
from pathlib import Path


def training_processes(job=None, ancestor=None):
    """This machine's training processes, lowest rank first: [{pid, ppid, rank, local_rank}].

    A training process has RANK and LOCAL_RANK in its environment (torchrun sets them, and so does
    03-job-launchers/rank_env.sh). job keeps those whose TORCHELASTIC_RUN_ID (torchrun's --rdzv-id) or
    SLURM_JOB_ID is job; ancestor keeps those started, directly or not, by that pid (e.g. a torchrun).
    """
    own_host = os.readlink("/proc/self/ns/uts")
    parents, found = {}, []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            # NOTE: the practice cluster's nodes share this machine's processes; a node is a hostname (UTS)
            # namespace, so "this machine" means the processes that see our hostname.
            if os.readlink(entry / "ns" / "uts") != own_host:
                continue
            text = (entry / "environ").read_bytes().decode(errors="replace")
            environ = dict(item.split("=", 1) for item in text.split("\0") if "=" in item)
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if "RANK" not in environ or "LOCAL_RANK" not in environ:
            continue
        if job is not None and job not in (environ.get("TORCHELASTIC_RUN_ID"), environ.get("SLURM_JOB_ID")):
            continue
        found.append({"pid": int(entry.name), "ppid": parents[int(entry.name)], "rank": int(environ["RANK"]),
                      "local_rank": int(environ["LOCAL_RANK"])})
    if ancestor is not None:
        found = [process for process in found if _descends_from(process["pid"], int(ancestor), parents)]
    return sorted(found, key=lambda process: (process["rank"], process["pid"]))


def _descends_from(pid, ancestor, parents):
    while pid > 1:
        pid = parents.get(pid, 0)
        if pid == ancestor:
            return True
    return False


def run_on_nodes(command, hosts=(), ssh="ssh", slurm_job=None, timeout=60):
    """[(node, exit code, output)] of `command` (a list) run once on each host, or on each node of a Slurm job."""
    if slurm_job is not None:
        return _run_in_slurm_job(command, slurm_job, timeout)
    # NOTE: ssh starts a login shell with its own PATH and folder: absolute paths and an explicit cd.
    remote = f"cd {shlex.quote(os.getcwd())} && exec {shlex.join(map(str, command))}"
    processes = [
        subprocess.Popen([*shlex.split(ssh), host, remote], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        for host in hosts
    ]
    results = []
    for host, process in zip(hosts, processes):
        try:
            output = process.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            process.kill()
            output = process.communicate()[0] + f"\n(no answer from {host} within {timeout} s)"
        results.append((host, process.returncode, output))
    return results


def _run_in_slurm_job(command, job_id, timeout):
    """One task on each node of a running job, in a step that shares the job's CPUs (--overlap): no waiting."""
    squeue = subprocess.run(["squeue", "-h", "-j", str(job_id), "-t", "RUNNING", "-o", "%D %N"],
                            capture_output=True, text=True, timeout=timeout)
    if squeue.returncode != 0 or not squeue.stdout.strip():
        raise SystemExit(f"error: Slurm job {job_id} is not running {squeue.stderr.strip()}")
    num_nodes, node_list = squeue.stdout.split()
    nodes = subprocess.run(["scontrol", "show", "hostnames", node_list], capture_output=True, text=True,
                           timeout=timeout).stdout.split()
    # NOTE: --label prefixes every line with its task number ("1: ..."), so the nodes' outputs can be told apart;
    # with one task a node, task i runs on the i-th node of the job's node list.
    srun = subprocess.run(
        ["srun", f"--jobid={job_id}", "--overlap", f"--nodes={num_nodes}", "--ntasks-per-node=1", "--label",
         *map(str, command)],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
    )
    outputs = {task: [] for task in range(len(nodes))}
    for line in srun.stdout.splitlines():
        task, _, text = line.partition(": ")
        if task.strip().isdigit() and int(task) in outputs:
            outputs[int(task)].append(text)
    return [(node, srun.returncode, "\n".join(outputs[task]) + "\n" + (srun.stderr if srun.returncode else ""))
            for task, node in enumerate(nodes)]
