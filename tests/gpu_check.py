"""Run every chapter on one CUDA GPU and print one table: tokens/s, MFU, peak memory, pass or fail.

    python tests/gpu_check.py                        # on a GPU machine: under 10 minutes, writes gpu_check.md
    python tests/gpu_check.py --device cpu --quick   # smoke test of this script on a CPU, every chapter

Each chapter runs at one process, the way a reader launches it (`python` for 01, `torchrun --standalone
--nproc_per_node=1` after), in three stages, the plan of which it prints first with its time estimates:
1. Side by side, the tiny model: every chapter's defaults (no flags, the whole way to its exported model), every
   chapter with --compile, and the CPU-offload paths of 04 and 05. These prove the CUDA paths run; their
   tokens/s, from processes that share the GPU, measure nothing.
2. One at a time, a model of Llama-3.2-1B's shape at 2048 tokens a sequence, eager, in every chapter that has a
   code path of its own at one process (05, 07 and 10 add nothing there that 04 and 06 do not run; 10's
   attention, at --cp 1 on one GPU, runs in stage 1).
3. One at a time, the same model with --compile in chapter 04 (FSDP, the usual way to train at scale), and with
   FlashAttention 2 in chapter 01 when flash-attn is installed.
The 1B runs are stopped once their last step is logged: they measure training, while their checkpoint (15 GB of
fp32 weights and Adam state) and export (5 GB) would cost more time than the training and are the same code
the tiny runs finish. The 1B model is built from a config with random weights, so nothing is downloaded;
everything runs offline in a temp folder that is deleted at the end.
"""
import argparse
import dataclasses
import datetime
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import launching

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
    "10": ROOT / "10-context-parallel" / "train_llm.py",
    "11": ROOT / "11-expert-parallel" / "train_llm.py",
}
BIG_EAGER = ("01", "02", "04", "06", "08", "09")
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
# NOTE: the whole check must end within 10 minutes on one H200. The stages' limits add up to at most the
# budget, so no run is cut short by another's overrun; 30 s stay for imports, setup and the table.
TOTAL_BUDGET_S = {"full": 570, "quick": 480}
MIN_START_S = 20  # NOTE: less than this is not enough for even a tiny run to start, train and save


@dataclasses.dataclass
class Run:
    chapter: str
    options: str  # what the table shows
    args: list
    steps: int | None  # the step the run must reach; None: the chapter's default (one epoch)
    until_last_log: bool = False  # stopped once `steps` is logged: the row measures training, not saving
    skipped: str | None = None


@dataclasses.dataclass
class Stage:
    """Runs launched together (side_by_side) or one after another. estimate_s: the expected seconds of one
    run (of the whole stage when side by side), startup, checkpoint and export included; limit_s: the most
    it may take before it is killed and its row fails."""

    what: str
    runs: list
    side_by_side: bool
    estimate_s: int
    limit_s: int

    def total(self, seconds):
        active = [run for run in self.runs if not run.skipped]
        return seconds if self.side_by_side and active else seconds * len(active)


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

    work_dir = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        model_dir = write_model_folder(work_dir / "model", setup["shape"])
        # (one batch more: the chapters hold one out for the validation loss)
        num_rows = setup["batch_size"] * (setup["steps"] + 1)
        corpus = write_corpus(work_dir / "corpus.txt", num_rows, setup["seq_length"])
        model_args = ["-m", model_dir, "-d", corpus, "-b", setup["batch_size"], "-s", setup["seq_length"],
                      "--max-steps", setup["steps"], "--log-freq", setup["log_freq"], "--ckpt-freq", 1000]
        stages = plan(args.quick, model_args, setup["steps"], flash=not args.quick and flash_attn_works())
        print(describe_plan(stages, TOTAL_BUDGET_S[mode], device_name), file=sys.stderr)
        rows = run_all(stages, work_dir, args.device, TOTAL_BUDGET_S[mode])
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)

    caption = (
        f"GPU check on {device_name}, torch {torch.__version__}, {datetime.date.today()}, one process a run. "
        "tokens/s and MFU: each run's last metrics line, never its first, which holds warm-up and compilation. "
        "MFU's peak: the one the chapter printed. Peak memory: the chapter's peak_memory_gb (on CUDA, the most "
        "torch allocated). time: the whole launch, with startup, checkpoint and export; for the 1B runs, up to "
        "their last logged step. The tiny runs share the GPU side by side: their tokens/s are no benchmark."
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


def plan(quick, model_args, steps, flash):
    """The stages in the order they run: the cheap proof that every path runs first, the costly rows last, so
    that if time runs out, what is lost is a measurement. estimate_s and limit_s are for one H200 (full) or a
    2-core CPU (quick), not yet measured on an H200: the table's time column is what to correct them with."""
    def every_chapter(options, args, **run):
        return [Run(chapter, options, own_model(chapter, args), **run) for chapter in CHAPTERS]

    if quick:
        # The same stages on the tiny model for 3 steps: side by side, then stopped after their last log line.
        tiny = f"tiny Llama, {steps} steps"
        return [
            Stage("side by side", [*every_chapter(tiny, model_args, steps=steps),
                                   Run("04", f"{tiny} --cpu-offload", [*model_args, "--cpu-offload"], steps)],
                  side_by_side=True, estimate_s=120, limit_s=300),
            Stage("one at a time, stopped after the last log line",
                  [Run(chapter, f"{tiny}, until logged", model_args, steps, until_last_log=True)
                   for chapter in ("01", "04")],
                  side_by_side=False, estimate_s=20, limit_s=80),
        ]
    big = f"1B -b 8 -s 2048, {steps} steps"
    offload_405b = ["--cpu-offload", "--activation-checkpointing", "--explicit-prefetch"]
    return [
        Stage("side by side, the tiny model", [
            *every_chapter("defaults (no flags)", [], steps=None),
            *every_chapter("--compile", ["--compile"], steps=None),
            Run("04", "--cpu-offload", ["--cpu-offload"], None),
            # the profiler's CUDA activity (kernels in the trace), which no CPU test reaches
            Run("04", "--profile", ["--profile"], None),
            Run("05", " ".join(offload_405b), offload_405b, None),
        ], side_by_side=True, estimate_s=100, limit_s=150),
        Stage("one at a time, 1B eager",
              [Run(chapter, big, model_args, steps, until_last_log=True) for chapter in BIG_EAGER],
              side_by_side=False, estimate_s=30, limit_s=40),
        Stage("1B --compile", [Run("04", f"{big} --compile", [*model_args, "--compile"], steps,
                                   until_last_log=True)], side_by_side=False, estimate_s=90, limit_s=120),
        Stage("1B flash_attention_2", [Run(
            "01", f"{big} flash_attention_2", [*model_args, "--attn-implementation", "flash_attention_2"], steps,
            until_last_log=True, skipped=None if flash else "skipped: flash-attn not installed",
        )], side_by_side=False, estimate_s=30, limit_s=45),
    ]


def own_model(chapter, args):
    """Chapter 11 trains mixtures of experts only: where the others get -m (a Llama), it keeps its default
    model, a tiny Mixtral."""
    if chapter != "11" or "-m" not in args:
        return args
    index = args.index("-m")
    return [*args[:index], *args[index + 2 :]]


def describe_plan(stages, budget_s, device_name):
    estimate = sum(stage.total(stage.estimate_s) for stage in stages)
    limit = sum(stage.total(stage.limit_s) for stage in stages)
    lines = [f"plan on {device_name}: about {estimate} s, at most {limit} s of the {budget_s} s budget"]
    for number, stage in enumerate(stages, 1):
        active = [run for run in stage.runs if not run.skipped]
        each = "together" if stage.side_by_side else "each"
        lines.append(f"  {number}. {stage.what}: {len(active)} runs, about {stage.estimate_s} s {each} "
                     f"(limit {stage.limit_s} s): " + ", ".join(f"{run.chapter} {run.options}" for run in active))
    return "\n".join(lines)


def flash_attn_works():
    try:
        import flash_attn  # noqa: F401
    except Exception:  # NOTE: a wheel built for another torch fails with errors other than ImportError
        return False
    return True


def run_all(stages, work_dir, device, budget_s):
    env = dict(os.environ)
    env.update(HF_HOME=str(work_dir / "hf-home"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    deadline = time.monotonic() + budget_s
    rows, count = [], sum(len(stage.runs) for stage in stages)
    for stage in stages:
        if stage.side_by_side:
            # NOTE: side by side, each run gets a share of the CPU: compilations would otherwise start as many
            # workers as there are cores, each.
            stage_env = {**env, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
            stage_deadline = min(deadline, time.monotonic() + stage.limit_s)
            launched = [start(run, work_dir, stage_env) if not run.skipped else None for run in stage.runs]
            ended_at = wait_side_by_side([started[0] for started in launched if started], stage_deadline)
            outcomes = [finish(run, started, stage_deadline - time.monotonic(), ended_at.get(started[0]))
                        if started else None for run, started in zip(stage.runs, launched)]
        else:
            outcomes = []
            for run in stage.runs:
                time_left = deadline - time.monotonic()
                outcomes.append(None if run.skipped or time_left < MIN_START_S else
                                finish(run, start(run, work_dir, env), min(stage.limit_s, time_left)))
        for run, outcome in zip(stage.runs, outcomes):
            if run.skipped:
                row = dict(result=run.skipped)
            elif outcome is None:
                row = dict(result=f"FAIL: not run, the check's {budget_s} s budget was spent")
            else:
                row = outcome
            rows.append({"chapter": run.chapter, "options": run.options, **row})
            print(f"[{len(rows)}/{count}] {run.chapter} {run.options}: {row['result']}", file=sys.stderr)
    return rows


def start(run, work_dir, env):
    """One launch in a folder of its own (it writes outputs/ there), its output into files there."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"run-{run.chapter}-", dir=work_dir))
    nproc = None if run.chapter == "01" else 1
    out, err = open(run_dir / "stdout.txt", "w"), open(run_dir / "stderr.txt", "w")
    with out, err:
        process = launching.start([*launching.command(CHAPTERS[run.chapter], nproc), *run.args], run_dir, env,
                                  stdout=out, stderr=err)
    return process, run_dir, time.monotonic()


def wait_side_by_side(processes, deadline):
    """Wait until every launch has exited or the deadline passed; returns when each one exited."""
    ended_at = {}
    while len(ended_at) < len(processes) and time.monotonic() < deadline:
        for process in processes:
            if process not in ended_at and process.poll() is not None:
                ended_at[process] = time.monotonic()
        time.sleep(0.5)
    return ended_at


def finish(run, started, timeout, ended_at=None):
    """Wait for a launch (stopping it once its last step is logged, for until_last_log), and make its row."""
    process, run_dir, start_time = started
    metrics_path = run_dir / "outputs" / "default" / "metrics.jsonl"

    def last_step_logged():
        return run.until_last_log and any(m["step"] == run.steps for m in launching.read_metrics(metrics_path))

    _, _, how = launching.wait(process, max(0.0, timeout), until=last_step_logged)
    seconds = (ended_at or time.monotonic()) - start_time
    metrics = launching.read_metrics(metrics_path)
    stdout, stderr = (run_dir / "stdout.txt").read_text(), (run_dir / "stderr.txt").read_text()
    shutil.rmtree(run_dir, ignore_errors=True)

    row = dict(seconds=seconds, **last_metrics(metrics, assumed_peak_tflops(stdout)))
    if how == "timed out":
        row["result"] = f"FAIL: timed out after {timeout:.0f} s (its share of the budget)"
    elif how == "exited" and process.returncode != 0:
        row["result"] = f"FAIL: exit {process.returncode}: {failure_reason(stderr, stdout)}"
    elif not metrics or "tokens_per_s" not in metrics[-1]:
        row["result"] = "FAIL: logged no tokens_per_s in metrics.jsonl"
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
