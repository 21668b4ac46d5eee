"""Chapter 03: chapter 02's script launched on a real two-node Slurm cluster (two network namespaces on this
machine, practice-cluster/up.sh) by sbatch, by torchrun by hand, by ssh_launch.sh, by mpirun; preemption and
requeue; a crashed worker restarted within the job; how many processes job.sbatch starts on
nodes with GPUs (fake nvidia-smi, no cluster); and the submit helper's checks.

Every multi-node run trains a global batch of 8 sequences (2 nodes x 2 processes x -b 2 under Slurm; 2 nodes
x 1 process x -b 4 by hand, to save process start-ups) and must log the per-step losses of one node running 4
processes (run_chapter("02", nproc=4)) within conftest's LOSS_TOLERANCE: fp32, the same samples in each step,
only the reduction order of the all-reduce differs.
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import launching
from conftest import (
    CHAPTERS, LOSS_TOLERANCE, PRACTICE, missing_system_tool, offline_env, run_chapter, wait_or_fail,
)
from launching import read_metrics

CHAPTER = CHAPTERS["03"]
TRAIN_SCRIPT = CHAPTERS["02"] / "train_llm.py"
STEPS = 40
GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def train_args(tiny_model, tiny_dataset):
    """conftest's common_args for STEPS steps; add batch_for(ranks) for the per-rank batch."""
    return ["-m", tiny_model, "--from-pretrained", "-d", tiny_dataset, "-s", 32, "--dtype", "float32",
            "--log-freq", 1, "--warmup-steps", 2, "--max-steps", STEPS]


def batch_for(ranks):
    return ["-b", GLOBAL_BATCH // ranks]


@pytest.fixture(scope="module")
def reference_losses(train_args, tmp_path_factory):
    """One node, 4 processes: the loss series every 2 x 2 launch must reproduce."""
    run = run_chapter("02", [*train_args, *batch_for(4)], tmp_path_factory.mktemp("reference"), nproc=4)
    assert len(run.losses) == STEPS
    return run.losses


@pytest.fixture(scope="module")
def work_dir(cluster, tmp_path_factory):
    """Where jobs run and write: a path both nodes see (they share this machine's filesystem)."""
    return tmp_path_factory.mktemp("jobs")


def launch_env(cluster, work_dir):
    env = offline_env(work_dir)
    env.update(SLURM_CONF=str(cluster / "slurm.conf"), PRACTICE_CLUSTER_DIR=str(cluster),
               PATH=f"{Path(sys.executable).parent}:{env['PATH']}")
    return env


def slurm(env, *command, cwd=None):
    result = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{' '.join(map(str, command))} failed: {result.stderr}"
    return result.stdout


def job_field(env, job_id, field):
    match = re.search(rf"\b{field}=(\S+)", slurm(env, "scontrol", "show", "job", "-o", job_id))
    return match[1]


def wait_for_job(env, job_id, timeout=400, until=None, poll=0.5):
    """Poll the job (every 0.5 s, sooner than sbatch --wait) until it has ended, or `until()` holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if until is not None and until():
            return None
        state = job_field(env, job_id, "JobState")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"):
            return state
        time.sleep(poll)
    subprocess.run(["scancel", job_id], env=env, timeout=60)
    pytest.fail(f"job {job_id} still {job_field(env, job_id, 'JobState')} after {timeout} s")


def job_log(work_dir, job_id):
    return "".join(path.read_text() for path in (work_dir / "logs").glob(f"*-{job_id}.out"))


def losses_of(exp_dir):
    return [m["loss"] for m in read_metrics(exp_dir / "metrics.jsonl")]


def losses_by_step(exp_dir):
    """{step: loss} from metrics.jsonl, the last line of a step winning (a resumed run logs its steps again);
    it can be read while the job writes."""
    return {m["step"]: m["loss"] for m in read_metrics(exp_dir / "metrics.jsonl")}


def assert_losses_match(losses, reference_losses):
    assert len(losses) == len(reference_losses)
    worst = max(abs(a - b) for a, b in zip(losses, reference_losses))
    assert worst < LOSS_TOLERANCE, f"losses differ from one node by up to {worst:.2e}"
    print(f"losses match one node within {worst:.1e}")


def run_on_nodes(commands, env, cwd, timeout=300):
    """Start one command on each node (practice-cluster/on-node.sh, like ssh), wait for all; kill all on a hang."""
    return run_all([[PRACTICE / "on-node.sh", node, *command] for node, command in commands.items()], env, cwd,
                   timeout)


def run_all(commands, env, cwd, timeout=300):
    """Start the commands, wait for all: ([exit codes], [outputs]); kill all of them, and fail, on a hang."""
    processes = [launching.start(command, cwd, env, stderr=subprocess.STDOUT) for command in commands]
    results = wait_or_fail(processes, timeout, str([str(command[0]) for command in commands]))
    return [code for code, _, _ in results], [output for _, output, _ in results]


def test_sbatch_on_two_nodes_matches_one_node(cluster, work_dir, train_args, reference_losses):
    env = launch_env(cluster, work_dir)
    env.update(PROCS_PER_NODE="2", TRAIN_SCRIPT=str(TRAIN_SCRIPT))
    (work_dir / "logs").mkdir(exist_ok=True)
    started = time.monotonic()
    job_id = slurm(env, "sbatch", "--parsable", CHAPTER / "job.sbatch", *map(str, train_args + batch_for(4)),
                   "--save-dir", work_dir / "outputs", "-e", "sbatch", cwd=work_dir).strip()
    state = wait_for_job(env, job_id)
    log = job_log(work_dir, job_id)
    assert state == "COMPLETED", log[-4000:]
    print(f"sbatch job on 2 nodes x 2 processes, {STEPS} steps: {time.monotonic() - started:.1f} s")
    assert "on node[0-1]: 2 nodes, rendezvous at node0:" in log
    # NOTE: each node counts its own GPUs (none here) and falls back to PROCS_PER_NODE; 4 ranks at -b 2 are
    # also what makes the losses match the one-node run of 4 processes.
    assert all(f"{node}: 0 GPUs: torchrun --nproc-per-node=2\n" in log for node in ("node0", "node1")), log[-4000:]
    assert_losses_match(losses_of(work_dir / "outputs" / "sbatch"), reference_losses)


def worker_pid(experiment, rank):
    """The pid of the training process with this global rank (torchrun's environment) in this experiment."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if experiment.encode() in argv and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    return None


def test_crashed_worker_is_restarted_from_the_checkpoint_within_the_job(cluster, work_dir, train_args,
                                                                       reference_losses):
    """SIGKILL one worker mid-job: torchrun (--max-restarts) starts the workers of both nodes again in the same
    allocation, they resume from the newest checkpoint, and the job ends like an uninterrupted run."""
    env = launch_env(cluster, work_dir)
    env.update(PROCS_PER_NODE="2", TRAIN_SCRIPT=str(TRAIN_SCRIPT))
    (work_dir / "logs").mkdir(exist_ok=True)
    exp_dir = work_dir / "outputs" / "crashed"
    ckpt_freq = 4
    job_id = slurm(env, "sbatch", "--parsable", CHAPTER / "job.sbatch", *map(str, train_args + batch_for(4)),
                   "--ckpt-freq", str(ckpt_freq), "--save-dir", work_dir / "outputs", "-e", "crashed",
                   cwd=work_dir).strip()
    # NOTE: kill once a checkpoint is written (step 4 is logged before it is saved, so wait for step 5), with
    # most of the STEPS still ahead (a step takes ~0.1 s: poll often). Rank 3: not rank 0, which saves.
    wait_for_job(env, job_id, until=lambda: len(losses_by_step(exp_dir)) > ckpt_freq, poll=0.05)
    victim = worker_pid("crashed", rank=3)
    assert victim is not None, f"no rank 3 left to kill: the job ran ahead\n{job_log(work_dir, job_id)[-4000:]}"
    killed_after = len(losses_by_step(exp_dir))
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    state = wait_for_job(env, job_id)
    log = job_log(work_dir, job_id)
    assert state == "COMPLETED" and job_field(env, job_id, "ExitCode") == "0:0", log[-4000:]
    assert job_field(env, job_id, "Restarts") == "0", log[-4000:]  # no requeue: the same allocation
    resumed_at = dict(re.findall(r"rank (\d+): resumed from \S+ at step (\d+)", log))
    assert sorted(resumed_at) == ["0", "1", "2", "3"] and len(set(resumed_at.values())) == 1, log[-4000:]
    resumed_step = int(resumed_at["0"])
    assert 0 < resumed_step < STEPS and resumed_step % ckpt_freq == 0
    print(f"rank 3 killed after step {killed_after}; all ranks restarted from step {resumed_step}; job done "
          f"{time.monotonic() - killed_at:.1f} s after the kill")
    losses = losses_by_step(exp_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert_losses_match([losses[step] for step in sorted(losses)], reference_losses)


def test_preempted_job_checkpoints_requeues_and_matches_uninterrupted_run(cluster, work_dir, train_args,
                                                                          reference_losses):
    """USR1 to the batch shell (what --signal=B:USR1@120 sends before the time limit): the training stops after a
    step with a checkpoint, the job requeues itself under the same id, and the second run resumes."""
    env = launch_env(cluster, work_dir)
    exp_dir = work_dir / "outputs" / "preempted"
    command = [sys.executable, CHAPTER / "submit.py", "--nodes", "2", "--procs-per-node", "2", "--chapter", "02",
               "--job-name", "preempt", "--", *map(str, train_args + batch_for(4)),
               "--save-dir", work_dir / "outputs", "-e", "preempted"]
    submitted = subprocess.run(command, env=env, cwd=work_dir, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job_id = re.search(r"submitted job (\d+)", submitted.stdout)[1]

    # the submit helper's dry run prints exactly the script Slurm stored for the job
    dry_run = subprocess.run([*command[:2], "--dry-run", *command[2:]], env=env, cwd=work_dir,
                             capture_output=True, text=True, timeout=60)
    stored = slurm(env, "scontrol", "write", "batch_script", job_id, "-")
    assert dry_run.stdout == stored
    assert (work_dir / "logs" / f"preempt-{job_id}.sbatch").read_text() == stored

    # NOTE: signal once a few steps are logged, with most of the STEPS still ahead (a step takes ~0.1 s).
    wait_for_job(env, job_id, until=lambda: len(losses_of(exp_dir)) >= 2)
    slurm(env, "scancel", "--signal=USR1", "--batch", job_id)
    state = wait_for_job(env, job_id)
    log = job_log(work_dir, job_id)
    assert state == "COMPLETED", log[-4000:]
    assert job_field(env, job_id, "Restarts") == "1", log[-4000:]
    assert "got USR1: stopping the training" in log and f"requeueing job {job_id}" in log
    # NOTE: \S+ and not .*: the four ranks' lines can interleave on one line of the shared log.
    resumed_at = dict(re.findall(r"rank (\d+): resumed from \S+ at step (\d+)", log))
    assert sorted(resumed_at) == ["0", "1", "2", "3"] and len(set(resumed_at.values())) == 1, log[-4000:]
    stopped_after = int(resumed_at["0"])
    assert 0 < stopped_after < STEPS
    print(f"preempted after step {stopped_after} of {STEPS}, resumed after the requeue")
    assert_losses_match(losses_of(exp_dir), reference_losses)


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_torchrun_by_hand_on_two_nodes_matches_one_node(cluster, work_dir, train_args, reference_losses,
                                                        rendezvous):
    env = launch_env(cluster, work_dir)
    commands = {}
    for node_rank, node in enumerate(["node0", "node1"]):
        if rendezvous == "static":
            launch = ["--node-rank", node_rank, "--master-addr", "node0", "--master-port", 29500]
        else:
            launch = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29400", "--rdzv-id", "by-hand"]
        commands[node] = ["torchrun", "--nnodes", 2, "--nproc-per-node", 1, *launch, TRAIN_SCRIPT, *train_args,
                          *batch_for(2),
                          "--save-dir", work_dir / "outputs", "-e", f"by-hand-{rendezvous}"]
    returncodes, outputs = run_on_nodes(commands, env, work_dir)
    assert returncodes == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert_losses_match(losses_of(work_dir / "outputs" / f"by-hand-{rendezvous}"), reference_losses)


def test_ssh_launch_over_a_hosts_file_matches_one_node(cluster, work_dir, train_args, reference_losses):
    """ssh_launch.sh: one ssh per line of the hosts file, each running torchrun with its node rank (static)."""
    ssh_config = cluster / "ssh" / "config"
    if not ssh_config.exists():
        missing_system_tool("needs sshd on the practice cluster (apt-get install openssh-server openssh-client)")
    env = launch_env(cluster, work_dir)
    env["SSH"] = f"ssh -F {ssh_config}"
    (work_dir / "hosts").write_text("node0\nnode1\n")
    started = time.monotonic()
    returncodes, outputs = run_all([[CHAPTER / "ssh_launch.sh", "hosts", 1, TRAIN_SCRIPT, *train_args,
                                     *batch_for(2), "--save-dir", work_dir / "outputs", "-e", "ssh"]], env, work_dir)
    assert returncodes == [0], outputs[0][-4000:]
    print(f"ssh_launch.sh on 2 nodes x 1 process, {STEPS} steps: {time.monotonic() - started:.1f} s")
    assert_losses_match(losses_of(work_dir / "outputs" / "ssh"), reference_losses)


def test_mpirun_on_two_nodes_matches_one_node(cluster, work_dir, train_args, reference_losses):
    if shutil.which("mpirun") is None:
        missing_system_tool("needs mpirun (apt-get install openmpi-bin)")
    env = launch_env(cluster, work_dir)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    forwarded = [arg for name in ("PATH", "HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE",
                                  "OMP_NUM_THREADS", "PYTHONUNBUFFERED") for arg in ("-x", name)]
    command = ["mpirun", "-np", 2, "--host", "node0:1,node1:1", "--mca", "plm_rsh_agent",
               PRACTICE / "node-rsh.sh", "-x", "MASTER_ADDR=node0", "-x", "MASTER_PORT=29500", *forwarded,
               CHAPTER / "rank_env.sh", sys.executable, TRAIN_SCRIPT, *train_args, *batch_for(2),
               "--save-dir", work_dir / "outputs", "-e", "mpirun"]
    returncodes, outputs = run_on_nodes({"node0": command}, env, work_dir)
    assert returncodes == [0], outputs[0][-4000:]
    assert_losses_match(losses_of(work_dir / "outputs" / "mpirun"), reference_losses)


FAKE_TOOLS = {
    # NOTE: srun starts the command once per node of FAKE_NODES ("node0:8 node1:8": name and GPU count), and
    # fails if a task fails.
    "srun": """#!/bin/bash
while [[ $1 == --* ]]; do shift; done
for node in $FAKE_NODES; do
    FAKE_NODE=${node%:*} SLURMD_NODENAME=${node%:*} FAKE_GPUS=${node#*:} "$@" & pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
""",
    # NOTE: `scontrol show node` as Slurm prints it, with the node's GRES from FAKE_GRES ("(null)": no GPUs).
    "scontrol": """#!/bin/bash
if [[ $1 == show && $2 == node ]]; then
    echo "NodeName=$3 Arch=x86_64 CoresPerSocket=48"
    echo "   CPUAlloc=0 CPUEfctv=96 CPUTot=96 CPULoad=0.01"
    echo "   Gres=${FAKE_GRES:-(null)}"
    echo "   CfgTRES=cpu=96,mem=2000000M,billing=96${FAKE_GRES:+,gres/gpu=8}"
else
    echo node0
fi
""",
    "hostname": "#!/bin/bash\necho $FAKE_NODE\n",
    # NOTE: what nvidia-smi -L prints on a node with FAKE_GPUS GPUs (and on one with none).
    "nvidia-smi": """#!/bin/bash
((FAKE_GPUS > 0)) || { echo "No devices were found"; exit 6; }
for ((i = 0; i < FAKE_GPUS; i++)); do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-$FAKE_NODE-$i)"; done
""",
    "torchrun": "#!/bin/bash\necho \"$FAKE_NODE: torchrun $*\"\n",
}


@pytest.mark.parametrize("nodes, env, gpus, procs", [
    ("node0:8 node1:8", {}, 8, 8),  # sbatch --nodes=2 job.sbatch on 8-GPU nodes: no SLURM_GPUS_ON_NODE
    ("node0:8 node1:8", {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 4, 4),  # a job given 4 of a node's 8 GPUs
    ("node0:8 node1:8", {"PROCS_PER_NODE": "2"}, 8, 8),  # PROCS_PER_NODE is for nodes without GPUs
    ("node0:0 node1:0", {"PROCS_PER_NODE": "2"}, 0, 2),  # nodes without GPUs, like the practice cluster's
    ("node0:0 node1:0", {}, 0, 1),
])
def test_job_sbatch_starts_one_process_per_gpu_on_each_node(tmp_path, nodes, env, gpus, procs):
    """job.sbatch with stand-ins for srun (one task per node), scontrol, hostname, nvidia-smi and torchrun
    (which prints its arguments): what each node's torchrun is told to start."""
    result = run_job_sbatch_with_fakes(tmp_path, nodes, env)
    assert result.returncode == 0, result.stdout + result.stderr
    launches = sorted(re.findall(r"^(node\d): torchrun (.*)$", result.stdout, re.MULTILINE))
    assert [node for node, _ in launches] == ["node0", "node1"], result.stdout
    for node, args in launches:
        assert args.startswith(f"--nproc-per-node={procs} --nnodes=2 --max-restarts=3 "), result.stdout
        assert f"\n{node}: {gpus} GPUs: torchrun --nproc-per-node={procs}\n" in result.stdout


def run_job_sbatch_with_fakes(tmp_path, nodes, env):
    """bash job.sbatch -e my-run as the batch shell runs it, with FAKE_TOOLS first on PATH and env on top."""
    for tool, text in FAKE_TOOLS.items():
        (tmp_path / tool).write_text(text)
        (tmp_path / tool).chmod(0o755)
    ours = ("CUDA_VISIBLE_DEVICES", "PROCS_PER_NODE", "MAX_RESTARTS", "FAKE_GRES")
    base = {name: value for name, value in os.environ.items()
            if name not in ours and not name.startswith("SLURM")}
    return subprocess.run(
        ["bash", CHAPTER / "job.sbatch", "-e", "my-run"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={**base, "PATH": f"{tmp_path}:{os.environ['PATH']}", "FAKE_NODES": nodes, "SLURM_JOB_ID": "42",
             "SLURM_JOB_NODELIST": "node[0-1]", "SLURM_NNODES": "2", "SLURM_SUBMIT_DIR": str(tmp_path), **env},
    )


# FAKE_GRES: the GRES Slurm lists for each node. What Slurm 22.05 sets in an srun step given GPUs (measured on
# the practice cluster with Gres=gpu:2); a step of an --exclusive job without --gpus-per-node gets only
# SLURM_JOB_GPUS, and no GPUs where devices are constrained.
STEP_GIVEN_8 = {"SLURM_STEP_GPUS": "0,1,2,3,4,5,6,7", "SLURM_GPUS_ON_NODE": "8",
                "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
FIX = "ask for them with #SBATCH --gpus-per-node=8 (or sbatch --gpus-per-node=8 job.sbatch ...)"


@pytest.mark.parametrize("gres, line", [
    ("gpu:8(S:0-1)", f"error: this node has GPUs (gpu:8) but the job sees none; {FIX}"),
    ("gpu:h100:8(S:0-1),shard:16", f"error: this node has GPUs (gpu:h100:8) but the job sees none; {FIX}"),
], ids=["gpu:8", "typed-gpu-and-shards"])
def test_job_sbatch_stops_every_node_with_one_line_when_the_step_cannot_see_its_gpus(tmp_path, gres, line):
    """A cluster that constrains devices, a job submitted without --gpus-per-node: the step sees none of the
    GPUs its nodes have. Each node stops with one error line before torchrun, not one CPU process a node."""
    result = run_job_sbatch_with_fakes(tmp_path, "node0:0 node1:0",
                                       {"FAKE_GRES": gres, "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7"})
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.splitlines() == [line] * 2, result.stderr
    assert "torchrun" not in result.stdout, result.stdout


@pytest.mark.parametrize("nodes, env, procs", [
    ("node0:0 node1:0", {"FAKE_GRES": "(null)"}, 1),  # no GPUs anywhere: the practice cluster
    ("node0:8 node1:8", {"FAKE_GRES": "gpu:8(S:0-1)", **STEP_GIVEN_8}, 8),  # --gpus-per-node=8
    ("node0:8 node1:8", {"FAKE_GRES": "gpu:8(S:0-1)"}, 8),  # devices not constrained: the step sees them all
    ("node0:0 node1:0", {"FAKE_GRES": "gpu:8(S:0-1)", "PROCS_PER_NODE": "2"}, 2),  # CPU processes on purpose
], ids=["no-gpus", "gpus-requested", "gpus-not-constrained", "procs-per-node"])
def test_job_sbatch_starts_the_training_when_the_job_sees_the_gpus_or_the_node_has_none(tmp_path, nodes, env,
                                                                                          procs):
    result = run_job_sbatch_with_fakes(tmp_path, nodes, env)
    assert result.returncode == 0 and "error:" not in result.stderr, result.stdout + result.stderr
    launches = re.findall(r"^node\d: torchrun --nproc-per-node=(\d+) ", result.stdout, re.MULTILINE)
    assert launches == [str(procs)] * 2, result.stdout


def submit_dry_run(*args, cwd=None):
    return subprocess.run([sys.executable, CHAPTER / "submit.py", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=60)


@pytest.fixture
def script_with_parallel_sizes(tmp_path):
    """A stand-in train_llm.py that takes --tp, --dp and --pp (the helper reads its flags, never runs it)."""
    script = tmp_path / "train_llm.py"
    script.write_text('parser.add_argument("--tp")\nparser.add_argument("--dp")\nparser.add_argument("--pp")\n')
    return script


@pytest.mark.parametrize("layout, message", [
    (["--nodes", 2, "--gpus-per-node", 8, "--", "--tp", 3],
     "error: tensor-parallel size 3 does not divide --gpus-per-node 8"),
    (["--nodes", 2, "--gpus-per-node", 8, "--", "--tp", 4, "--dp", 2],
     "error: dp 2 x tp 4 = 8 ranks, but --nodes 2 x --gpus-per-node 8 = 16 processes"),
    (["--nodes", 1, "--procs-per-node", 4, "--", "--tp=8"],
     "error: tensor-parallel size 8 does not divide --procs-per-node 4"),
    (["--nodes", 3, "--gpus-per-node", 8, "--", "--pp", 2, "--tp", 8],
     "error: pp 2 x tp 8 = 16 does not divide --nodes 3 x --gpus-per-node 8 = 24 processes"),
    (["--nodes", 4, "--gpus-per-node", 8, "--", "--pp", 4, "--dp", 2, "--tp", 8],
     "error: pp 4 x dp 2 x tp 8 = 64 ranks, but --nodes 4 x --gpus-per-node 8 = 32 processes; make them equal "
     "(dp 1 for pp 4, tp 8)"),
])
def test_submit_rejects_layouts_that_do_not_fit_the_gpus(script_with_parallel_sizes, tmp_path, layout, message):
    result = submit_dry_run("--script", script_with_parallel_sizes, "--dry-run", *layout, cwd=tmp_path)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].startswith(message), result.stderr
    assert not (tmp_path / "logs").exists()


def test_submit_accepts_a_3d_layout_that_fills_the_gpus(tmp_path):
    result = submit_dry_run("--nodes", 4, "--gpus-per-node", 8, "--chapter", "09", "--dry-run", "--", "--pp", 4,
                            "--dp", 1, "--tp", 8, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "09-3d-parallel/train_llm.py" in result.stdout and "set -- --pp 4 --dp 1 --tp 8" in result.stdout


def test_submit_rejects_a_parallel_size_the_chapter_does_not_take(tmp_path):
    result = submit_dry_run("--nodes", 2, "--gpus-per-node", 8, "--chapter", "02", "--dry-run", "--", "--tp", 2,
                            cwd=tmp_path)
    assert result.returncode != 0
    assert "02-distributed-data-parallel/train_llm.py takes no --tp" in result.stderr


def test_submit_names_the_chapters_that_exist_when_asked_for_one_that_does_not(tmp_path):
    result = submit_dry_run("--nodes", 2, "--chapter", "99", "--dry-run", cwd=tmp_path)
    assert result.returncode != 0
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("error: no chapter '99' with a train_llm.py"), result.stderr
    chapters = [p.parent.name for p in CHAPTER.parent.glob("[0-9][0-9]-*/train_llm.py")]
    assert "02-distributed-data-parallel" in chapters
    for chapter in chapters:
        # NOTE: chapter 01 runs without torchrun, so it is not offered.
        assert (f"{chapter[:2]} ({chapter})" in message) == (not chapter.startswith("01")), message


def test_submit_dry_run_writes_the_layout_into_job_sbatch(script_with_parallel_sizes, tmp_path):
    result = submit_dry_run("--script", script_with_parallel_sizes, "--nodes", 4, "--gpus-per-node", 8,
                            "--partition", "gpu", "--time", "4:00:00", "--dry-run", "--", "--tp", 4, "--dp", 8,
                            "-e", "my run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    script = result.stdout
    directives = re.findall(r"^#SBATCH (\S+)$", script, re.MULTILINE)
    assert {"--nodes=4", "--gpus-per-node=8", "--partition=gpu", "--time=4:00:00",
            "--signal=B:USR1@120", "--requeue", f"--output={tmp_path}/logs/%x-%j.out"} <= set(directives)
    assert script.count("#SBATCH --nodes=") == 1
    assert f"export TRAIN_SCRIPT={script_with_parallel_sizes}\n" in script
    assert "set -- --tp 4 --dp 8 -e 'my run'\n" in script
    assert "export PROCS_PER_NODE" not in script  # GPU nodes: one process per allocated GPU
    # the body after the settings is job.sbatch's, unchanged
    assert script.endswith((CHAPTER / "job.sbatch").read_text().split("set -uo pipefail", 1)[1])
