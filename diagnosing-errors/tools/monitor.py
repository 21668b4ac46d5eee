"""top for a multi-node training job: a line per node, a line per GPU and per training process, a cluster line.

    python tools/monitor.py                              # this machine, refreshed every 2 s (Ctrl-C stops)
    python tools/monitor.py --hosts node0 node1          # every node, over ssh
    python tools/monitor.py --slurm-job 1234             # every node of a running Slurm job
    python tools/monitor.py --count 1                    # one sample, then exit (for logs and scripts)

Per node: CPU use and load, memory, and with nvidia-smi each GPU's utilisation, power and memory; then each
training process (RANK and LOCAL_RANK in its environment) with its CPU use, resident memory and state.
What to look for: a rank whose CPU (or GPU power) differs from the others', a node whose GPUs draw less power
(they wait for a straggler; a GPU waiting in an NCCL kernel still shows 100% utilisation), a process in
state D (stuck in the kernel: a filesystem or a driver), memory that only grows.
"""
import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from jobs import run_on_nodes, training_processes

GIB = 1024**3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", nargs="+", default=[], help="sample these hosts over ssh")
    parser.add_argument("--ssh", default="ssh", help="the ssh command, e.g. 'ssh -F my-config'")
    parser.add_argument("--slurm-job", help="sample every node of this running Slurm job")
    parser.add_argument("--job", help="only processes of this torchrun --rdzv-id or Slurm job id")
    parser.add_argument("--pid", type=int, help="only processes started by this one (on this machine)")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    parser.add_argument("--count", type=int, help="refresh this many times, then exit")
    parser.add_argument("--sample", action="store_true", help="print this machine's sample as JSON (internal)")
    args = parser.parse_args()
    job = args.job or args.slurm_job
    window = min(1.0, args.interval / 2)
    if args.sample:
        print(json.dumps(sample_node(window, job, args.pid)))
        return
    command = [sys.executable, Path(__file__).resolve(), "--sample", "--interval", args.interval,
               *(["--job", job] if job else [])]
    refresh = 0
    while args.count is None or refresh < args.count:
        started = time.monotonic()
        if args.hosts or args.slurm_job:
            samples = [parse_sample(node, code, output)
                       for node, code, output in run_on_nodes(command, args.hosts, args.ssh, args.slurm_job)]
        else:
            samples = [sample_node(window, job, args.pid)]
        # NOTE: on a terminal, redraw in place like top; into a file or a pipe, append one block a refresh.
        clear = "\033[H\033[2J" if sys.stdout.isatty() else ""
        print(clear + time.strftime("%H:%M:%S ") + render(samples), flush=True)
        refresh += 1
        if args.count is None or refresh < args.count:
            time.sleep(max(0.0, args.interval - (time.monotonic() - started)))


def sample_node(window, job=None, ancestor=None):
    """This machine over `window` seconds: CPU, memory, GPUs and the training processes, as a dict."""
    processes = training_processes(job, ancestor)
    cpu_before, process_before = _cpu_times(), {p["pid"]: _process_cpu_seconds(p["pid"]) for p in processes}
    started = time.monotonic()
    time.sleep(window)
    # NOTE: the time that really passed: on a busy machine the sleep overruns, and the percentages with it.
    window = time.monotonic() - started
    cpu_after = _cpu_times()
    busy = (cpu_after[0] - cpu_before[0]) / max(1, cpu_after[1] - cpu_before[1])
    memory = _meminfo()
    gpus, gpu_memory_by_pid = _nvidia_smi()
    for process in processes:
        try:
            used = _process_cpu_seconds(process["pid"]) - process_before[process["pid"]]
            status = dict(line.split(":", 1) for line in Path(f"/proc/{process['pid']}/status").read_text()
                          .splitlines() if ":" in line)
        except OSError:  # exited during the window
            process["state"] = "exited"
            continue
        process.update(cpu_percent=100 * used / window, rss=int(status["VmRSS"].split()[0]) * 1024,
                       state=status["State"].split("(")[-1].rstrip(")"),
                       gpu_memory=gpu_memory_by_pid.get(process["pid"]))
    return {"host": socket.gethostname(), "cpus": os.cpu_count(), "cpu_percent": 100 * busy,
            "load": os.getloadavg()[0], "memory_used": memory["MemTotal"] - memory["MemAvailable"],
            "memory_total": memory["MemTotal"], "gpus": gpus, "processes": processes}


def _cpu_times():
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    fields = [int(value) for value in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _process_cpu_seconds(pid):
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _meminfo():
    return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text()
            .splitlines()}


def _nvidia_smi():
    """([{index, util, power, memory_used, memory_total}], {pid: GPU memory}); ([], {}) without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return [], {}
    query = ["nvidia-smi", "--format=csv,noheader,nounits"]
    gpus_csv = subprocess.run([*query, "--query-gpu=index,utilization.gpu,power.draw,memory.used,memory.total"],
                              capture_output=True, text=True, timeout=30).stdout
    apps_csv = subprocess.run([*query, "--query-compute-apps=pid,used_memory"], capture_output=True, text=True,
                              timeout=30).stdout
    gpus = []
    for line in gpus_csv.strip().splitlines():
        index, util, power, used, total = (_number(value) for value in line.split(","))
        gpus.append({"index": index, "util": util, "power": power, "memory_used": used, "memory_total": total})
    # NOTE: in a container nvidia-smi may report the host's pids, which then match none of ours.
    memory_by_pid = {}
    for line in apps_csv.strip().splitlines():
        pid, used = (_number(value) for value in line.split(","))
        memory_by_pid[int(pid)] = used
    return gpus, memory_by_pid


def _number(text):
    """nvidia-smi's value as a number; None for "[N/A]" (e.g. power on GPUs that do not report it)."""
    try:
        return float(text)
    except ValueError:
        return None


def parse_sample(node, code, output):
    """The JSON sample a node printed, or a stand-in that says why there is none."""
    for line in output.splitlines():
        if line.startswith("{"):
            return json.loads(line)
    return {"host": node, "error": f"no sample (exit {code}): {output.strip()[-300:]}"}


def render(samples):
    """The screen: per node a summary, its GPUs and its training processes; then the whole cluster."""
    lines = [f"{len(samples)} node{'s' * (len(samples) != 1)}"]
    for node in samples:
        if "error" in node:
            lines.append(f"{node['host']:<10} {node['error']}")
            continue
        memory = f"{node['memory_used'] / GIB:6.1f}/{node['memory_total'] / GIB:.1f} GiB"
        lines.append(f"{node['host']:<10} cpu {node['cpu_percent']:3.0f}% of {node['cpus']:>3} cpus  load "
                     f"{node['load']:5.1f}  mem {memory}" + _gpu_summary(node["gpus"]))
        for gpu in node["gpus"]:
            used = _value(gpu["memory_used"] and gpu["memory_used"] / 1024, "")
            total = _value(gpu["memory_total"] and gpu["memory_total"] / 1024, " GiB")
            lines.append(f"  gpu {gpu['index']:.0f}    util {_value(gpu['util'], '%')}  "
                         f"power {_value(gpu['power'], ' W')}  mem {used}/{total}")
        for process in node["processes"]:
            if process.get("state") == "exited":
                continue
            gpu_memory = process.get("gpu_memory")
            lines.append(f"  rank {process['rank']:<4} local {process['local_rank']:<3} pid {process['pid']:<8} "
                         f"cpu {process['cpu_percent']:4.0f}%  rss {process['rss'] / 2**20:6.0f} MiB  "
                         f"{process['state']}" + (f"  gpu mem {gpu_memory / 1024:.1f} GiB" if gpu_memory else ""))
    nodes = [node for node in samples if "error" not in node]
    cpus = sum(node["cpus"] for node in nodes)
    ranks = sum(len(node["processes"]) for node in nodes)
    all_gpus = [gpu for node in nodes for gpu in node["gpus"]]
    cpu_percent = sum(n["cpu_percent"] * n["cpus"] for n in nodes) / max(1, cpus)
    lines.append(
        f"{'cluster':<10} cpu {cpu_percent:3.0f}% of {cpus:>3} cpus  "
        f"ranks {ranks:<3} mem {sum(n['memory_used'] for n in nodes) / GIB:6.1f}/"
        f"{sum(n['memory_total'] for n in nodes) / GIB:.1f} GiB" + _gpu_summary(all_gpus)
        + (f"  {len(samples) - len(nodes)} node(s) not answering" if len(nodes) < len(samples) else ""))
    return "\n".join(lines)


def _gpu_summary(gpus):
    """Mean utilisation, total power and memory of these GPUs, or nothing without GPUs."""
    if not gpus:
        return ""
    utils = [gpu["util"] for gpu in gpus if gpu["util"] is not None]
    power = sum(gpu["power"] or 0 for gpu in gpus)
    used = sum(gpu["memory_used"] or 0 for gpu in gpus) / 1024
    total = sum(gpu["memory_total"] or 0 for gpu in gpus) / 1024
    return (f"  {len(gpus)} gpus util {sum(utils) / max(1, len(utils)):3.0f}%  power {power:5.0f} W"
            f"  gpu mem {used:.1f}/{total:.1f} GiB")


def _value(number, unit):
    return "n/a" if number is None else f"{number:.0f}{unit}" if unit in ("%", " W") else f"{number:.1f}{unit}"


if __name__ == "__main__":
    main()
