"""Train chapter 01's tiny Llama at several global batch sizes and learning rates on the same number of
tokens, and print each run's final loss as a table, with the learning rates that the linear and square-root
rules predict.

    python sweep.py                                    # 5 batch sizes x 7 learning rates (README's table)
    python sweep.py --batch-sizes 8 32 --lrs 1e-3 4e-3

Each run is `python 01-single-gpu/train_llm.py -b B --lr LR --max-steps TOKENS/(B x SEQ)`, launched as a
subprocess (one per CPU core at a time), fp32 and one thread each, so the numbers do not depend on how many
run side by side. Warmup is the same fraction of every run, so every schedule has the same shape in tokens.
"""
import argparse
import concurrent.futures
import json
import math
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CHAPTER_01 = os.path.join(HERE, "..", "..", "01-single-gpu", "train_llm.py")


def main():
    args = get_parser().parse_args()
    sequences = args.tokens // args.seq_length
    for batch_size in args.batch_sizes:
        if sequences % batch_size:
            sys.exit(f"error: --tokens {args.tokens} is {sequences} sequences of {args.seq_length}, which "
                     f"batch size {batch_size} does not divide; use batch sizes that divide {sequences}")
    runs = [(batch_size, lr) for batch_size in args.batch_sizes for lr in args.lrs]
    jobs = args.jobs or min(len(runs), os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        final_losses = dict(zip(runs, pool.map(lambda run: train(args, *run), runs)))
    failed = [message for message in final_losses.values() if isinstance(message, str)]
    if failed:
        sys.exit(failed[0])

    table = format_table(args, final_losses)
    print(table)
    os.makedirs(args.save_dir, exist_ok=True)
    with open(os.path.join(args.save_dir, "sweep.json"), "w") as f:
        json.dump([{"batch_size": batch_size, "lr": lr, "final_loss": loss}
                   for (batch_size, lr), loss in final_losses.items()], f)
    with open(os.path.join(args.save_dir, "sweep.md"), "w") as f:
        f.write(table + "\n")


def get_parser():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", type=positive(int), nargs="+", default=[2, 4, 8, 32, 128],
                        help="global batch sizes (sequences a step); the first is the rules' base")
    parser.add_argument("--lrs", type=positive(float), nargs="+",
                        default=[5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2],
                        help="peak learning rates to try at every batch size")
    parser.add_argument("--tokens", type=positive(int), default=262144,
                        help="training tokens of every run (default: 2048 sequences of 128, < one epoch)")
    parser.add_argument("-s", "--seq-length", type=positive(int), default=128)
    parser.add_argument("--warmup-fraction", type=float, default=0.1, help="of each run's steps")
    parser.add_argument("--windows", type=positive(int), default=8,
                        help="the final loss is the mean over the last 1/windows of the steps")
    parser.add_argument("--max-steps", type=positive(int), default=None,
                        help="cut every run to this many steps (a quick check of the script, not a result)")
    parser.add_argument("--jobs", type=positive(int), default=None,
                        help="runs at a time (default: one per CPU core)")
    parser.add_argument("--save-dir", default="outputs/sweep", help="where each run's folder is written")
    return parser


def positive(number_type):
    def parse(text):
        value = number_type(text)
        if not value > 0 or math.isinf(value):
            raise argparse.ArgumentTypeError(f"{text} is not a positive number")
        return value

    return parse


def scaled_lr(base_lr, base_batch_size, batch_size, rule):
    """The learning rate for batch_size that a rule derives from one tuned at base_batch_size.

    linear (Goyal et al. 2017, SGD): k times the batch, k times the learning rate, with warmup.
    sqrt (Hoffer et al. 2017; Malladi et al. 2022 for Adam): k times the batch, sqrt(k) times the rate.
    """
    ratio = batch_size / base_batch_size
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    raise ValueError(f"unknown scaling rule {rule!r}; use 'linear' or 'sqrt'")


def train(args, batch_size, lr):
    """Run chapter 01 once; returns the mean loss of its last window, or an error line."""
    steps = args.tokens // args.seq_length // batch_size
    if args.max_steps:
        steps = min(steps, args.max_steps)
    experiment = f"b{batch_size}-lr{lr:g}-steps{steps}"
    command = [
        sys.executable, CHAPTER_01, "-b", batch_size, "--lr", lr, "-s", args.seq_length, "--dtype", "float32",
        "--max-steps", steps, "--warmup-steps", max(1, round(args.warmup_fraction * steps)),
        # One log line per window: the last line's loss is the mean over the last 1/windows of the run.
        "--log-freq", max(1, steps // args.windows), "--ckpt-freq", steps,
        "--save-dir", args.save_dir, "-e", experiment,
    ]
    # NOTE: one thread per run: a run's numbers then do not depend on how many cores it got.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(list(map(str, command)), capture_output=True, text=True, env=env)
    if done.returncode != 0:
        last_line = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"error: run {experiment} exited {done.returncode}: {last_line}"
    with open(os.path.join(args.save_dir, experiment, "metrics.jsonl")) as f:
        return json.loads(f.read().splitlines()[-1])["loss"]


def format_table(args, final_losses):
    """A markdown table: one row per batch size, one column per learning rate, the best of each row in bold,
    and the learning rates the two rules derive from the best one of the first batch size."""
    base_batch_size = args.batch_sizes[0]
    base_lr = min(args.lrs, key=lambda lr: final_losses[base_batch_size, lr])
    lines = [
        f"final loss (mean over the last 1/{args.windows} of each run), {args.tokens:,} tokens a run "
        f"(-s {args.seq_length})" + (f", runs cut to {args.max_steps} steps" if args.max_steps else ""),
        "",
        "| global batch | steps | " + " | ".join(f"lr {lr:.3g}" for lr in args.lrs)
        + " | best lr | linear rule | sqrt rule |",
        "|---" * (len(args.lrs) + 5) + "|",
    ]
    for batch_size in args.batch_sizes:
        losses = [final_losses[batch_size, lr] for lr in args.lrs]
        best = min(range(len(losses)), key=losses.__getitem__)
        cells = [f"**{loss:.4f}**" if i == best else f"{loss:.4f}" for i, loss in enumerate(losses)]
        steps = args.tokens // args.seq_length // batch_size
        lines.append(
            f"| {batch_size} | {min(steps, args.max_steps or steps)} | " + " | ".join(cells)
            + f" | {args.lrs[best]:.3g} | {scaled_lr(base_lr, base_batch_size, batch_size, 'linear'):.3g}"
            + f" | {scaled_lr(base_lr, base_batch_size, batch_size, 'sqrt'):.3g} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
