"""Draw one profiled step of every rank as a timeline, from the Chrome traces that a chapter's --profile writes:
a row of compute (forward, backward, optimizer) and a row of communication (the collectives and sends) per rank.

    torchrun --nproc_per_node=2 ../../02-distributed-data-parallel/train_llm.py --profile --max-steps 4 -e ddp
    python timeline.py outputs/ddp/profile -o ddp-timeline.png --title "chapter 02, DDP"

The step drawn is the last one profiled (the launch's step 4). Time 0 is the earliest start of that step on any
rank: one machine's ranks share a clock, so a rank that waits for another shows the wait. On a GPU the kernels
get a row of their own per rank.
"""
import argparse
import json
from pathlib import Path

COLOURS = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green", "other": "tab:gray",
           "communication": "tab:red", "gpu kernels": "tab:purple"}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile_dir", type=Path, help="an experiment's profile/ folder (rank-N.json files)")
    parser.add_argument("-o", "--out", type=Path, default=Path("timeline.png"))
    parser.add_argument("--title", default=None)
    args = parser.parse_args()
    bars = load_bars(args.profile_dir)
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


def step_events(trace_path):
    """The last ProfilerStep event of a trace and every complete event that starts within it."""
    events = [event for event in json.loads(trace_path.read_text())["traceEvents"] if event.get("ph") == "X"]
    step = max((event for event in events if event["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
    end = step["ts"] + step["dur"]
    return step, [event for event in events if step["ts"] <= event["ts"] <= end and event is not step]


def classify(step, events, origin):
    """Collectives and point-to-point sends (gloo:..., nccl:...) on any thread are communication; the operators
    of the training thread that no other operator contains are compute, in the phase they run in: backward
    inside autograd's functions, optimizer inside Optimizer.step, forward before the first backward, other
    after it (the gradient norm and clipping, the loss bookkeeping); GPU kernels, a row of their own."""
    def spans(prefix):
        return [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith(prefix)]

    backward, optimizer = spans("autograd::engine::evaluate_function"), spans("Optimizer.step")
    bars = []
    for event in events:
        start, duration = (event["ts"] - origin) / 1000, event["dur"] / 1000
        if event["name"].split(":")[0] in ("gloo", "nccl"):
            bars.append(("communication", "communication", start, duration, event["name"]))
        elif event.get("cat") == "kernel":
            kind = "communication" if "nccl" in event["name"].lower() else "gpu kernels"
            bars.append(("gpu kernels", kind, start, duration, event["name"]))
    operators = sorted((e for e in events if e.get("cat") == "cpu_op" and e["tid"] == step["tid"]
                        and e["name"].startswith("aten::")), key=lambda e: (e["ts"], -e["dur"]))
    covered_until = float("-inf")
    for event in operators:
        if event["ts"] < covered_until:
            continue  # inside the operator before it
        covered_until = event["ts"] + event["dur"]
        middle = event["ts"] + event["dur"] / 2
        if any(start <= middle <= end for start, end in optimizer):
            phase = "optimizer"
        elif any(start <= middle <= end for start, end in backward):
            phase = "backward"
        elif not backward or middle < min(start for start, _ in backward):
            phase = "forward"
        else:
            phase = "other"
        bars.append(("compute", phase, (event["ts"] - origin) / 1000, event["dur"] / 1000, event["name"]))
    return bars


def draw(bars, out, title):
    import matplotlib

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
