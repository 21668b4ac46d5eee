"""Submit a chapter's train_llm.py to Slurm on any number of nodes, after checking that the layout fits.

    python submit.py --nodes 4 --gpus-per-node 8 --partition gpu --time 4:00:00 --chapter 02 -- -e my-run
    python submit.py --nodes 2 --procs-per-node 2 --chapter 02 --dry-run -- -e cpu-run    # nodes without GPUs
    python submit.py --nodes 2 --gpus-per-node 8 --script my_2d/train_llm.py -- --tp 4    # checks 4 divides 8
    python submit.py --nodes 4 --gpus-per-node 8 --chapter 09 -- --pp 4 --tp 8          # checks 4 x 8 = 32 GPUs

Arguments after `--` go to train_llm.py. The script submitted is job.sbatch with this job's #SBATCH options and
arguments written in; it is kept as logs/<job-name>-<job-id>.sbatch beside the job's log, so `sbatch` of that
file reruns (or, with the same -e, resumes) exactly this job. --dry-run prints it instead of submitting.
"""
import argparse
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
JOB_TEMPLATE = HERE / "job.sbatch"
# NOTE: the flags by which chapters take their parallel sizes; a size not given is 1 (tp, pp) or "the rest" (dp).
TP_FLAGS = ("--tp", "--tp-size", "--tensor-parallel-size")
DP_FLAGS = ("--dp", "--dp-size", "--data-parallel-size")
PP_FLAGS = ("--pp", "--pp-size", "--pipeline-parallel-size")


def main():
    args, train_args = parse_args(sys.argv[1:])
    train_script = find_train_script(args)
    check_flags_exist(train_script, train_args)
    check_layout(args.nodes, args.gpus_per_node or args.procs_per_node, args.gpus_per_node > 0, train_args)
    log_dir = Path(args.log_dir).resolve()
    script = render_job_script(args, train_script, train_args, log_dir)
    if args.dry_run:
        print(script, end="")
        return
    log_dir.mkdir(parents=True, exist_ok=True)
    pending_path = log_dir / f"{args.job_name}-{time.strftime('%Y%m%d-%H%M%S')}.sbatch"
    pending_path.write_text(script)
    submitted = subprocess.run(["sbatch", "--parsable", str(pending_path)], capture_output=True, text=True)
    if submitted.returncode != 0:
        sys.exit(f"error: sbatch refused the job ({submitted.stderr.strip()}); the script is in {pending_path}")
    job_id = submitted.stdout.strip().split(";")[0]
    kept_path = log_dir / f"{args.job_name}-{job_id}.sbatch"
    pending_path.rename(kept_path)
    log_path = log_dir / f"{args.job_name}-{job_id}.out"
    print(f"submitted job {job_id}: script {kept_path}, log {log_path}")
    if args.follow:
        follow(job_id, log_path)


def parse_args(argv):
    """submit.py's own options, and the arguments after `--` for train_llm.py."""
    if "--" in argv:
        split = argv.index("--")
        argv, train_args = argv[:split], argv[split + 1 :]
    else:
        train_args = []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, required=True, help="number of nodes")
    parser.add_argument("--gpus-per-node", type=int, default=0,
                        help="GPUs per node; one training process per GPU (0: nodes without GPUs, see --procs-per-node)")
    parser.add_argument("--procs-per-node", type=int, default=None,
                        help="training processes per node on nodes without GPUs (gloo on CPU)")
    parser.add_argument("--partition", default=None, help="Slurm partition (default: the cluster's default)")
    parser.add_argument("--time", default=None, help="time limit, e.g. 4:00:00 (default: the partition's)")
    parser.add_argument("--chapter", default="02", help="chapter whose train_llm.py runs, e.g. 02 or 04")
    parser.add_argument("--script", default=None, help="a train_llm.py to run instead of --chapter's")
    parser.add_argument("--job-name", default="train-llm", help="Slurm job name, also the log's name")
    parser.add_argument("--log-dir", default="logs", help="where the job's log and its sbatch script go")
    parser.add_argument("--dry-run", action="store_true", help="print the sbatch script; submit nothing")
    parser.add_argument("--follow", action="store_true", help="print the job's log as it grows, until the job ends")
    args = parser.parse_args(argv)
    if args.nodes < 1:
        parser.error(f"--nodes {args.nodes}: a job needs at least 1 node")
    if args.gpus_per_node < 0:
        parser.error(f"--gpus-per-node {args.gpus_per_node}: pass 0 or more")
    if args.gpus_per_node > 0 and args.procs_per_node not in (None, args.gpus_per_node):
        parser.error(f"--procs-per-node {args.procs_per_node} with --gpus-per-node {args.gpus_per_node}: "
                     "on GPU nodes there is one process per GPU; drop --procs-per-node")
    if args.gpus_per_node == 0:
        args.procs_per_node = args.procs_per_node or 1
        if args.procs_per_node < 1:
            parser.error(f"--procs-per-node {args.procs_per_node}: pass 1 or more")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", args.job_name):
        parser.error(f"--job-name {args.job_name!r}: use letters, digits, '.', '_' or '-' (it names files)")
    return args, train_args


def find_train_script(args):
    if args.script is not None:
        script = Path(args.script).resolve()
        if not script.is_file():
            sys.exit(f"error: --script {args.script} does not exist; pass the path of a train_llm.py")
        return script
    chapter = args.chapter.split("-")[0].zfill(2)
    if chapter == "01":
        sys.exit("error: chapter 01 trains on one device without torchrun; pass --chapter 02 or later")
    found = sorted(ROOT.glob(f"{chapter}-*/train_llm.py"))
    if not found:
        # NOTE: chapters are added over time: name the ones this checkout has, not the ones planned.
        chapters = sorted(p.parent.name for p in ROOT.glob("[0-9][0-9]-*/train_llm.py"))
        listed = ", ".join(f"{name[:2]} ({name})" for name in chapters if not name.startswith("01"))
        sys.exit(f"error: no chapter {args.chapter!r} with a train_llm.py (planned chapters have none yet); "
                 f"pass one of: {listed}")
    return found[0]


def check_flags_exist(train_script, train_args):
    """A parallel size the chapter does not take would only fail once the job has waited in the queue."""
    source = train_script.read_text()
    for arg in train_args:
        name = arg.partition("=")[0]
        if name in TP_FLAGS + DP_FLAGS + PP_FLAGS and f'"{name}"' not in source:
            sys.exit(f"error: {train_script.parent.name}/train_llm.py takes no {name}; drop it or pick a chapter that does")


def check_layout(nodes, procs_per_node, on_gpus, train_args):
    """Exit with one line if the chapter's parallel sizes cannot tile nodes x processes per node."""
    world_size = nodes * procs_per_node
    unit = "--gpus-per-node" if on_gpus else "--procs-per-node"
    tp = flag_value(train_args, TP_FLAGS) or 1
    pp = flag_value(train_args, PP_FLAGS) or 1
    dp = flag_value(train_args, DP_FLAGS)
    if tp < 1 or pp < 1 or (dp is not None and dp < 1):
        sys.exit(f"error: parallel sizes must be 1 or more (got pp {pp}, dp {dp}, tp {tp})")
    # NOTE: a tensor-parallel group exchanges activations in every layer: it must stay inside one node's fast
    # links, so its size divides the processes of a node.
    if procs_per_node % tp != 0:
        sys.exit(f"error: tensor-parallel size {tp} does not divide {unit} {procs_per_node}; a TP group must "
                 f"fit inside one node: use a TP size that divides {procs_per_node}")
    # Pipeline stages take the ranks in blocks of dp x tp, so pp x tp must divide them; dp is the rest.
    if world_size % (pp * tp) != 0:
        sys.exit(f"error: pp {pp} x tp {tp} = {pp * tp} does not divide --nodes {nodes} x {unit} "
                 f"{procs_per_node} = {world_size} processes; use sizes whose product divides {world_size}")
    if dp is not None and pp * dp * tp != world_size:
        sizes = f"dp {dp} x tp {tp} = {dp * tp}" if pp == 1 else f"pp {pp} x dp {dp} x tp {tp} = {pp * dp * tp}"
        sys.exit(f"error: {sizes} ranks, but --nodes {nodes} x {unit} {procs_per_node} = "
                 f"{world_size} processes; make them equal (dp {world_size // (pp * tp)} for"
                 f"{f' pp {pp},' if pp > 1 else ''} tp {tp})")


def flag_value(train_args, names):
    """The integer value of the last of `names` in train_args (`--tp 4` or `--tp=4`), or None."""
    value = None
    for i, arg in enumerate(train_args):
        name, _, inline = arg.partition("=")
        if name in names:
            text = inline if inline else (train_args[i + 1] if i + 1 < len(train_args) else "")
            try:
                value = int(text)
            except ValueError:
                sys.exit(f"error: {name} needs a whole number, got {text!r}")
    return value


def render_job_script(args, train_script, train_args, log_dir):
    """job.sbatch with this job's #SBATCH options, and the script and arguments it runs written in."""
    directives = {
        "--job-name": args.job_name,
        "--nodes": str(args.nodes),
        "--output": f"{log_dir}/%x-%j.out",
        "--gpus-per-node": str(args.gpus_per_node) if args.gpus_per_node else None,
        "--partition": args.partition,
        "--time": args.time,
    }
    lines = JOB_TEMPLATE.read_text().splitlines()
    last_directive = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH "))
    for i, line in enumerate(lines):
        option = line.split("=")[0].split()[-1] if line.startswith("#SBATCH ") else None
        if option in directives:
            value = directives.pop(option)
            lines[i] = f"#SBATCH {option}={value}"
    added = [f"#SBATCH {option}={value}" for option, value in directives.items() if value is not None]
    # NOTE: --dry-run and --follow change nothing in the job, so a dry run prints exactly what sbatch gets.
    recorded = [a for a in sys.argv[1:] if a not in ("--dry-run", "--follow")]
    command = " ".join(shlex.quote(a) for a in ["python", "submit.py", *recorded])
    settings = [
        f"# Written by: {command}",
        f"export TRAIN_SCRIPT={shlex.quote(str(train_script))}",
        *([f"export PROCS_PER_NODE={args.procs_per_node}"] if not args.gpus_per_node else []),
        f"set -- {' '.join(shlex.quote(a) for a in train_args)}".rstrip(),
    ]
    lines[last_directive + 1 : last_directive + 1] = added + settings
    return "\n".join(lines) + "\n"


def follow(job_id, log_path):
    """Print the log as it grows until the job has left the queue (requeues included)."""
    printed = 0
    while True:
        if log_path.exists():
            text = log_path.read_text(errors="replace")
            print(text[printed:], end="", flush=True)
            printed = len(text)
        queued = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
        if queued.returncode != 0 or not queued.stdout.strip():
            break
        time.sleep(2)
    if log_path.exists():
        print(log_path.read_text(errors="replace")[printed:], end="")
    state = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    match = re.search(r"JobState=(\S+).*?ExitCode=(\S+)", state, re.DOTALL)
    print(f"job {job_id} ended: {match[1]}, exit code {match[2]}" if match else f"job {job_id} ended")


if __name__ == "__main__":
    main()
