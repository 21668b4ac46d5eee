"""Draw one profiled step of every rank as a timeline, from the Chrome traces that a chapter's --profile writes:
a row of compute (forward, backward, optimizer) and a row of communication (the collectives and sends) per rank.

    torchrun --nproc_per_node=2 ../../02-distributed-data-parallel/train_llm.py --profile --max-steps 5 -e ddp
    python timeline.py outputs/ddp/profile -o ddp-timeline.png --title "chapter 02, DDP"
    python timeline.py outputs/pp/profile --bubble     # chapter 08: how long each rank idles in the pipeline

The step drawn is the last one profiled (the launch's step 4). Time 0 is the earliest start of that step on any
rank: one machine's ranks share a clock, so a rank that waits for another shows the wait (across nodes the
clocks may differ by more than a step's collectives). On a GPU the kernels get a row of their own per rank.
Draw a fresh profile/ folder: rank files left there by an earlier launch with more ranks would be drawn too.
"""
import argparse
import json
import sys
from pathlib import Path

COLOURS = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green", "other": "tab:gray",
           "communication": "tab:red", "gpu kernels": "tab:purple"}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile_dir", type=Path, help="an experiment's profile/ folder (rank-N.json files)")
    parser.add_argument("-o", "--out", type=Path, default=Path("timeline.png"))
    parser.add_argument("--title", default=None)
    parser.add_argument("--bubble", action="store_true", help="print each rank's idle share of the pipeline too")
    args = parser.parse_args()
    bars = load_bars(args.profile_dir)
    if args.bubble:
        for rank, idle in bubble(bars).items():
            print(f"rank {rank}: idle {idle:.1%} of the pipeline (first forward to last backward, any rank)")
    draw(bars, args.out, args.title or str(args.profile_dir))
    print(f"wrote {args.out}")


def load_bars(profile_dir):
    """{rank: [(row, kind, start_ms, duration_ms, name)]}, times from the earliest start of the drawn step."""
    traces = sorted(profile_dir.glob("rank-*.json"), key=lambda path: int(path.stem.split("-")[1]))
    if not traces:
        raise SystemExit(f"error: no rank-N.json in {profile_dir}; run a chapter with --profile first")
    steps = {int(path.stem.split("-")[1]): step_events(path) for path in traces}
    origin = min(step["ts"] for step, _ in steps.values())
    return {rank: classify(step, events, origin) for rank, (step, events) in steps.items()}


GPU_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


def step_events(trace_path):
    """The last ProfilerStep of a trace (the training thread's annotation) and the events within it: the CPU's
    within its span, the GPU's within the GPU's copy of it (the kernels run after the CPU launched them)."""
    events = [event for event in json.loads(trace_path.read_text())["traceEvents"] if event.get("ph") == "X"]

    def last_step(category):
        steps = [e for e in events if e["name"].startswith("ProfilerStep#") and e.get("cat") == category]
        return max(steps, key=lambda e: e["ts"]) if steps else None

    step = last_step("user_annotation")
    gpu_step = last_step("gpu_user_annotation") or step

    def within(event, span):
        return span["ts"] <= event["ts"] <= span["ts"] + span["dur"] and event is not span

    return step, [event for event in events
                  if within(event, gpu_step if event.get("cat") in GPU_EVENTS else step)
                  and event.get("cat") != "gpu_user_annotation"]


def classify(step, events, origin):
    """Collectives and point-to-point sends (gloo:..., nccl:..., as the CPU calls them) are communication; the
    operators of the threads that train (the step's thread, and autograd's where backward runs) that no other
    operator contains are compute, in the phase they run in: backward inside autograd's functions, optimizer
    inside Optimizer.step, forward before the last backward ends (a pipeline interleaves them), other after it
    (the gradient norm and clipping, logging, a checkpoint); GPU kernels and copies get a row of their own, NCCL's
    kernels coloured as communication."""
    def spans(prefix):
        return [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith(prefix)]

    backward, optimizer = spans("autograd::engine::evaluate_function"), spans("Optimizer.step")
    backward_end = max((end for _, end in backward), default=float("-inf"))
    training_threads = {step["tid"]} | {e["tid"] for e in events
                                        if e["name"].startswith("autograd::engine::evaluate_function")}
    bars = []
    for event in events:
        start, duration = (event["ts"] - origin) / 1000, event["dur"] / 1000
        if event["name"].split(":")[0] in ("gloo", "nccl"):
            bars.append(("communication", "communication", start, duration, event["name"]))
        elif event.get("cat") in GPU_EVENTS:
            kind = "communication" if "nccl" in event["name"].lower() else "gpu kernels"
            bars.append(("gpu kernels", kind, start, duration, event["name"]))
    operators = sorted((e for e in events if e.get("cat") == "cpu_op" and e["tid"] in training_threads
                        and e["name"].startswith("aten::")), key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    covered_until = {}
    for event in operators:
        if event["ts"] < covered_until.get(event["tid"], float("-inf")):
            continue  # inside the operator before it on its thread
        covered_until[event["tid"]] = event["ts"] + event["dur"]
        middle = event["ts"] + event["dur"] / 2
        if any(start <= middle <= end for start, end in optimizer):
            phase = "optimizer"
        elif any(start <= middle <= end for start, end in backward):
            phase = "backward"
        elif middle < backward_end or not backward:
            phase = "forward"
        else:
            phase = "other"
        bars.append(("compute", phase, (event["ts"] - origin) / 1000, event["dur"] / 1000, event["name"]))
    return bars


def bubble(bars):
    """{rank: the share of the pipeline's span in which the rank runs no forward or backward operator}; the span
    runs from the first forward on any rank to the last backward on any rank. It counts the CPU's operators: on
    a GPU they are launches, so it refuses a GPU profile (read the kernels row of the picture there)."""
    if any(bar[0] == "gpu kernels" for rank_bars in bars.values() for bar in rank_bars):
        raise SystemExit("error: the bubble counts CPU operators, which on a GPU only launch kernels; read the "
                         "picture's kernel rows instead")
    busy = {}
    for rank, rank_bars in bars.items():
        spans = sorted((start, start + duration) for row, kind, start, duration, _ in rank_bars
                       if row == "compute" and kind in ("forward", "backward"))
        merged = []
        for start, end in spans:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        busy[rank] = merged
    if not all(busy.values()):
        raise SystemExit("error: a rank ran no forward or backward in the profiled step")
    begin = min(spans[0][0] for spans in busy.values())
    end = max(spans[-1][1] for spans in busy.values())
    return {rank: 1 - sum(stop - start for start, stop in spans) / (end - begin) for rank, spans in busy.items()}


def draw(bars, out, title):
    try:
        import matplotlib
    except ModuleNotFoundError:
        sys.exit("error: timeline.py draws with matplotlib: pip install -r requirements.txt")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(rank, row) for rank in sorted(bars) for row in ("compute", "communication", "gpu kernels")
            if any(bar[0] == row for bar in bars[rank])]
    figure, axes = plt.subplots(figsize=(11, 0.6 * len(rows) + 1.4))
    for y, (rank, row) in enumerate(reversed(rows)):
        for kind in COLOURS:
            ranges = [(start, duration) for bar_row, bar_kind, start, duration, _ in bars[rank]
                      if bar_row == row and bar_kind == kind]
            if ranges:
                axes.broken_barh(ranges, (y - 0.35, 0.7), color=COLOURS[kind])
    axes.set_yticks(range(len(rows)), [f"rank {rank} {row}" for rank, row in reversed(rows)])
    axes.set_xlabel("ms from the start of the step")
    axes.set_title(title, pad=28)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour) for kind, colour in COLOURS.items()
               if any(bar[1] == kind for rank_bars in bars.values() for bar in rank_bars)]
    labels = [kind for kind in COLOURS if any(bar[1] == kind for rank_bars in bars.values() for bar in rank_bars)]
    axes.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, 1.0),
                ncol=len(labels), frameon=False)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    main()
