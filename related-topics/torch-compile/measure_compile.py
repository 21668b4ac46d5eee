"""Run a chapter's train_llm.py eager and with --compile, from the same weights on the same data, and print
the time of the first step, the steady time of a step, and how far the compiled losses are from eager's.

    python measure_compile.py                                   # chapter 01, 40 steps each
    python measure_compile.py --chapter 02 --nproc 2 --max-steps 10

Each run is the chapter's own command (`python train_llm.py`, or `torchrun --nproc_per_node=N train_llm.py`)
with --log-freq 1 and --dtype float32, so metrics.jsonl has every step's loss and tokens/s: a step's time is
its tokens divided by its tokens/s. The first step of a compiled run includes the compilation.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CHAPTERS = {"01": "01-single-gpu", "02": "02-distributed-data-parallel",
            "04": "04-fully-sharded-data-parallel", "06": "06-tensor-parallel"}


def main():
    args = get_parser().parse_args()
    if args.chapter == "01" and args.nproc != 1:
        sys.exit("error: chapter 01 runs on one process; pass --nproc 1, or --chapter 02, 04 or 06")
    runs = {mode: train(args, mode) for mode in ("eager", "compile")}
    tokens_per_step = args.batch_size * args.nproc * args.seq_length
    print(f"chapter {args.chapter}, {args.nproc} process(es), -b {args.batch_size} -s {args.seq_length}, "
          f"{args.max_steps} steps, fp32\n")
    print("| | first step (s) | steady step (s), median of steps 2.. |\n|---|---|---|")
    for mode, metrics in runs.items():
        times = [tokens_per_step / m["tokens_per_s"] for m in metrics]
        steady = f"{statistics.median(times[1:]):.3f}" if len(times) > 1 else "n/a (one step)"
        print(f"| {mode} | {times[0]:.2f} | {steady} |")
    differences = [abs(a["loss"] - b["loss"]) for a, b in zip(runs["eager"], runs["compile"])]
    print(f"\nlargest loss difference, compile vs eager, over {len(differences)} steps: "
          f"{max(differences):.2e}")


def get_parser():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chapter", choices=CHAPTERS, default="01")
    parser.add_argument("--nproc", type=positive_int, default=1, help="processes (torchrun), chapters 02-06")
    parser.add_argument("-b", "--batch-size", type=positive_int, default=8, help="per process")
    parser.add_argument("-s", "--seq-length", type=positive_int, default=128)
    parser.add_argument("--max-steps", type=positive_int, default=40)
    parser.add_argument("--save-dir", default="outputs/compile", help="where the two runs' folders go")
    return parser


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def train(args, mode):
    script = os.path.join(HERE, "..", "..", CHAPTERS[args.chapter], "train_llm.py")
    launcher = [sys.executable] if args.chapter == "01" else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"
    ]
    experiment = f"ch{args.chapter}-{args.nproc}-{mode}-{args.max_steps}"
    command = [*launcher, script, "-b", args.batch_size, "-s", args.seq_length, "--dtype", "float32",
               "--max-steps", args.max_steps, "--log-freq", 1, "--save-dir", args.save_dir, "-e", experiment]
    command = list(map(str, command)) + (["--compile"] if mode == "compile" else [])
    # A folder left by an earlier measurement would be resumed, not trained again.
    shutil.rmtree(os.path.join(args.save_dir, experiment), ignore_errors=True)
    # NOTE: one thread per process, as torchrun sets for several: timings then compare across chapters.
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        sys.exit(f"error: {' '.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    with open(os.path.join(args.save_dir, experiment, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


if __name__ == "__main__":
    main()
