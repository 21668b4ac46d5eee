"""Run every chapter on one CUDA GPU and print one table: tokens/s, MFU, peak memory, pass or fail.

    python tests/gpu_check.py                        # on a GPU machine: under 10 minutes, writes gpu_check.md
    python tests/gpu_check.py --device cpu --quick   # smoke test of this script on a CPU, every chapter

Each chapter runs at one process, the way a reader launches it (`python` for 01, `torchrun --standalone
--nproc_per_node=1` after): first its default tiny run (no flags), then a model of Llama-3.2-1B's shape at 2048
tokens a sequence, eager. The four chapters every later one builds on (01, 02, 04, 06) also run the 1B model
with --compile and with FlashAttention 2 when flash-attn is installed; 05 and 07 add nothing at one process
that their parents' 1B runs do not cover, so they run the default only. The 1B model is built from a config with random weights, so nothing is downloaded;
everything runs offline in a temp folder that is deleted at the end.
"""
import argparse
import dataclasses
import datetime
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = {
    "01": ROOT / "01-single-gpu" / "train_llm.py",
    "02": ROOT / "02-distributed-data-parallel" / "train_llm.py",
    "04": ROOT / "04-fully-sharded-data-parallel" / "train_llm.py",
    "05": ROOT / "05-training-llama-405b" / "train_llm.py",
    "06": ROOT / "06-tensor-parallel" / "train_llm.py",
    "07": ROOT / "07-2d-parallel" / "train_llm.py",
    "08": ROOT / "08-pipeline-parallel" / "train_llm.py",
    "09": ROOT / "09-3d-parallel" / "train_llm.py",
}
CORE = ("01", "02", "04", "06")
BIG_EAGER = (*CORE, "08", "09")
# NOTE: the shape of meta-llama/Llama-3.2-1B (1.24B parameters). Token ids are the ByT5 byte tokenizer's: its
# 259 tokens use the first rows of the 128256-row embedding, which costs the same FLOPs as a real vocabulary.
LLAMA_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
    max_position_embeddings=131072, bos_token_id=None, eos_token_id=1, pad_token_id=0,
)
TINY_LLAMA = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
    vocab_size=272, max_position_embeddings=256, bos_token_id=None, eos_token_id=1, pad_token_id=0,
)
# NOTE: 20 steps logged every 10: the first interval holds CUDA warm-up and compilation, the second (steps
# 11-20) is the steady speed the table shows. -b 8 x 2048 tokens fits an H200 with room to spare: 20 GB of
# fp32 weights, gradients and Adam state plus an estimated 55 GB of activations and fp32 logits.
FULL = dict(shape=LLAMA_1B, batch_size=8, seq_length=2048, steps=20, log_freq=10)
# -b 4: chapters 08 and 09 split each batch into 4 micro-batches by default.
QUICK = dict(shape=TINY_LLAMA, batch_size=4, seq_length=64, steps=3, log_freq=1)
# NOTE: the whole check must end within 10 minutes on one H200. Each run has its own limit (compilation costs
# more) and never gets more than what is left of the total; 20 s stay for imports, setup and the table.
TOTAL_BUDGET_S = {"full": 580, "quick": 480}
MIN_START_S = 20  # NOTE: less than this is not enough for even a tiny run to start, train and save


@dataclasses.dataclass
class Run:
    chapter: str
    options: str  # what the table shows
    args: list
    limit_s: int
    steps: int | None  # the step the run must reach; None: the chapter's default (one epoch)
    skipped: str | None = None


def main():
    parser = get_parser()
    args = parser.parse_args()
    if args.device == "cpu" and not args.quick:
        parser.error("--device cpu needs --quick: a 1B model at 2048 tokens would take hours on a CPU")

    import torch  # NOTE: imported here so that --help answers without torch's import time

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check needs a CUDA GPU and sees none (on a CPU, --device cpu --quick tests this script)")
        return 0
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    mode = "quick" if args.quick else "full"
    setup = QUICK if args.quick else FULL

    work_dir = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=scratch_root()))
    try:
        model_dir = write_model_folder(work_dir / "model", setup["shape"])
        num_rows = setup["batch_size"] * setup["steps"]
        corpus = write_corpus(work_dir / "corpus.txt", num_rows, setup["seq_length"])
        model_args = ["-m", model_dir, "-d", corpus, "-b", setup["batch_size"], "-s", setup["seq_length"],
                      "--max-steps", setup["steps"], "--log-freq", setup["log_freq"], "--ckpt-freq", 1000]
        runs = plan_runs(args.quick, model_args, setup)
        rows = run_all(runs, work_dir, args.device, TOTAL_BUDGET_S[mode])
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)

    caption = (
        f"GPU check on {device_name}, torch {torch.__version__}, {datetime.date.today()}, one process a run. "
        "tokens/s and MFU: each run's last metrics line, never its first, which holds warm-up and compilation. "
        "MFU's peak: the one the chapter printed. Peak memory: the chapter's peak_memory_gb (on CUDA, the most "
        "torch allocated). time: the whole launch, with startup, the final checkpoint and the export."
    )
    table = format_table(caption, rows)
    print(table)
    Path(args.out).write_text(table + "\n")
    print(f"written to {args.out}", file=sys.stderr)
    return 1 if any(row["result"].startswith("FAIL") for row in rows) else 0


def get_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu hides every GPU from the chapters (only with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke mode: a tiny model, 3 steps, each chapter once without --compile")
    parser.add_argument("--out", default="gpu_check.md", help="where to write the table (Markdown)")
    return parser


def scratch_root():
    # NOTE: each 1B run ends with a checkpoint (15 GB: fp32 weights and Adam state) and an export (5 GB).
    # Written to RAM (/dev/shm) that takes seconds; to a slow disk, minutes. Each run's folder is deleted after.
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 40e9:
        return "/dev/shm"
    return None  # tempfile's default


def write_model_folder(path, shape):
    """config.json and a byte tokenizer, no weights: without --from-pretrained a chapter builds the model from
    the config with random weights."""
    import transformers

    transformers.LlamaConfig(**shape).save_pretrained(path)
    transformers.ByT5Tokenizer(extra_ids=0).save_pretrained(path)
    return path


def write_corpus(path, num_rows, seq_length, seed=0):
    """A .txt file (one document a line) that packs into at least num_rows rows of seq_length + 1 tokens."""
    # NOTE: the ByT5 tokenizer gives one token per ASCII character plus an EOS a line, so this many characters
    # are at least this many tokens; 10% more covers what packing drops. The chapters' built-in corpus (289k
    # tokens) packs into only 17 steps of 8 x 2049.
    num_chars = math.ceil(1.1 * num_rows * (seq_length + 1))
    rng = random.Random(seed)
    words = ["the", "cat", "dog", "sat", "ran", "on", "a", "mat", "red", "blue", "big", "small", "and", "then"]
    lines, total = [], 0
    while total < num_chars:
        line = " ".join(rng.choice(words) for _ in range(rng.randint(20, 200))) + "."
        lines.append(line)
        total += len(line)
    path.write_text("\n".join(lines) + "\n")
    return path


def plan_runs(quick, model_args, setup):
    """The rows of the table, in the order they run: cheapest first, so that if the budget runs out, the runs
    left out are the costly ones; FlashAttention, an optional extra, last."""
    steps = setup["steps"]
    if quick:
        return [Run(chapter, f"tiny Llama, {steps} steps", model_args, 90, steps) for chapter in CHAPTERS]
    flash_missing = None if flash_attn_works() else "skipped: flash-attn not installed"
    big = f"1B -b {setup['batch_size']} -s {setup['seq_length']}"
    flash = ["--attn-implementation", "flash_attention_2"]
    return [
        *(Run(chapter, "defaults (no flags)", [], 45, None) for chapter in CHAPTERS),
        *(Run(chapter, big, model_args, 60, steps) for chapter in BIG_EAGER),
        *(Run(chapter, f"{big} --compile", [*model_args, "--compile"], 150, steps) for chapter in CORE),
        *(Run(chapter, f"{big} flash_attention_2", [*model_args, *flash], 60, steps, flash_missing)
          for chapter in CORE),
    ]


def flash_attn_works():
    try:
        import flash_attn  # noqa: F401
    except Exception:  # NOTE: a wheel built for another torch fails with errors other than ImportError
        return False
    return True


def run_all(runs, work_dir, device, budget_s):
    env = dict(os.environ)
    env.update(HF_HOME=str(work_dir / "hf-home"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    deadline = time.monotonic() + budget_s
    rows = []
    for index, run in enumerate(runs):
        time_left = deadline - time.monotonic()
        if run.skipped:
            row = dict(result=run.skipped)
        elif time_left < MIN_START_S:
            row = dict(result=f"FAIL: not run, the check's {budget_s} s budget was spent")
        else:
            row = launch(run, work_dir / f"run-{index:02d}", env, timeout=min(run.limit_s, time_left))
        rows.append({"chapter": run.chapter, "options": run.options, **row})
        print(f"[{index + 1}/{len(runs)}] {run.chapter} {run.options}: {row['result']}", file=sys.stderr)
    return rows


def launch(run, run_dir, env, timeout):
    """One launch in its own folder (it writes outputs/ there), killed with its process group past timeout."""
    script = CHAPTERS[run.chapter]
    command = [sys.executable, str(script)] if run.chapter == "01" else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(script)
    ]
    run_dir.mkdir()
    start = time.monotonic()
    process = subprocess.Popen(
        [*command, *map(str, run.args)], cwd=run_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        timed_out = True
    except KeyboardInterrupt:
        os.killpg(process.pid, signal.SIGKILL)  # NOTE: Ctrl-C does not reach a launch in its own session
        raise
    seconds = time.monotonic() - start
    metrics_file = next(run_dir.rglob("metrics.jsonl"), None)
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file else []
    shutil.rmtree(run_dir, ignore_errors=True)

    row = dict(seconds=seconds, **last_metrics(metrics, assumed_peak_tflops(stdout)))
    if timed_out:
        row["result"] = f"FAIL: timed out after {timeout:.0f} s (its share of the budget)"
    elif process.returncode != 0:
        row["result"] = f"FAIL: exit {process.returncode}: {failure_reason(stderr, stdout)}"
    elif not metrics or "tokens_per_s" not in metrics[-1]:
        row["result"] = "FAIL: exited 0 but logged no tokens_per_s in metrics.jsonl"
    elif run.steps is not None and metrics[-1]["step"] != run.steps:
        row["result"] = f"FAIL: ended at step {metrics[-1]['step']}, not {run.steps}"
    elif not math.isfinite(metrics[-1]["loss"]):
        row["result"] = f"FAIL: loss {metrics[-1]['loss']}"
    else:
        row["result"] = "pass"
    return row


def last_metrics(metrics, peak_tflops):
    if not metrics:
        return {}
    last = metrics[-1]
    row = dict(tokens_per_s=last.get("tokens_per_s"), peak_memory_gb=last.get("peak_memory_gb"))
    if "mfu" in last:
        peak = f"{peak_tflops:g}" if peak_tflops else "?"
        row["mfu"] = f"{100 * last['mfu']:.1f}% of {peak} TFLOP/s"
    return row


def assumed_peak_tflops(stdout):
    """The peak the chapter divided by, from a line it printed such as 'MFU is relative to 989 TFLOP/s, ...'.
    Read loosely: any number with a T-, P- or plain FLOP unit on a line that mentions MFU."""
    for line in stdout.splitlines():
        if "mfu" not in line.lower():
            continue
        match = re.search(r"(\d+(?:\.\d+)?(?:e[+-]?\d+)?)\s*([TP]?)FLOP", line, flags=re.IGNORECASE)
        if match:
            return float(match.group(1)) * {"T": 1, "P": 1000, "": 1e-12}[match.group(2).upper()]
    return None


def failure_reason(stderr, stdout):
    """The one line that says why: the chapter's own 'error: ...' line, else the last exception line. torchrun's
    ChildFailedError only says that a child failed, so it is passed over; the prefixes torchrun puts before a
    child's lines ('[rank0]:', 'traceback :') are dropped."""
    for text in (stderr, stdout):
        lines = [re.sub(r"^(\[rank\d+\]:|traceback\s*:)\s*", "", line.strip()) for line in text.splitlines()]
        for line in reversed(lines):
            is_exception = re.match(r"[\w.]*(Error|Exception)\b", line) and "ChildFailedError" not in line
            if line.startswith("error:") or is_exception:
                return line[:200]
    last_lines = [line.strip() for line in (stderr + stdout).splitlines() if line.strip()]
    return last_lines[-1][:200] if last_lines else "no output"


def format_table(caption, rows):
    lines = [
        caption,
        "",
        "| chapter | options | tokens/s | MFU | peak memory GB | time s | result |",
        "|---|---|---:|---|---:|---:|---|",
    ]
    for row in rows:
        cells = [
            row["chapter"],
            row["options"],
            f"{row['tokens_per_s']:,.0f}" if row.get("tokens_per_s") is not None else "-",
            row.get("mfu", "-"),
            f"{row['peak_memory_gb']:.1f}" if row.get("peak_memory_gb") is not None else "-",
            f"{row['seconds']:.0f}" if "seconds" in row else "-",
            row["result"].replace("|", "\\|"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
