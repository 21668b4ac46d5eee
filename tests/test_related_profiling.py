"""related-topics/profiling: timeline.py draws the last profiled step of every rank from the traces that
--profile writes, and each chapter's step shows what the README's paragraph under its picture says."""
import pytest

from conftest import ROOT
from launching import load_script

TIMELINE = load_script(ROOT / "related-topics" / "profiling" / "timeline.py")
# chapter: (processes, flags). The chapters' default tiny Llama, as in the README's pictures: its gradients fill
# 2 of DDP's buckets (the tests' smaller model fills 1, whose all-reduce cannot start before the backward ends).
RUNS = {"02": (2, ["-b", 4]), "04": (2, ["-b", 4]), "06": (2, ["-b", 8]), "08": (2, ["-b", 8])}
DEFAULT_MODEL = ["-s", 32, "--dtype", "float32", "--max-steps", 5, "--profile"]


@pytest.fixture(scope="module")
def timelines(launch_once, tmp_path_factory):
    """Each chapter's bars ({rank: [(row, kind, start_ms, duration_ms, name)]}), after drawing its picture."""
    pictures = tmp_path_factory.mktemp("timelines")
    bars_by_chapter = {}
    for chapter, (nproc, flags) in RUNS.items():
        run = launch_once(chapter, [*flags, *DEFAULT_MODEL], nproc=nproc)
        bars = TIMELINE["load_bars"](run.exp_dir / "profile")
        TIMELINE["draw"](bars, pictures / f"{chapter}.png", f"chapter {chapter}")
        assert (pictures / f"{chapter}.png").stat().st_size > 10_000
        assert sorted(bars) == list(range(nproc))
        bars_by_chapter[chapter] = bars
    return bars_by_chapter


def starts(bars, kind, name=""):
    return [start for _, bar_kind, start, _, bar_name in bars if bar_kind == kind and name in bar_name]


def ends(bars, kind):
    return [start + duration for _, bar_kind, start, duration, _ in bars if bar_kind == kind]


def test_ddp_all_reduces_a_bucket_while_the_backward_still_runs(timelines):
    for rank, bars in timelines["02"].items():
        assert min(starts(bars, "communication", "all_reduce")) < max(ends(bars, "backward")), rank
        assert not [start for start in starts(bars, "communication", "all_reduce")
                    if start < min(starts(bars, "backward"))], "DDP communicates in backward only"


def test_fsdp_gathers_weights_in_forward_and_backward_and_reduces_gradients_in_backward(timelines):
    for rank, bars in timelines["04"].items():
        backward_start, backward_end = min(starts(bars, "backward")), max(ends(bars, "backward"))
        gathers = starts(bars, "communication", "all_gather")
        assert any(start < backward_start for start in gathers), rank
        assert any(backward_start < start < backward_end for start in gathers), rank
        reductions = starts(bars, "communication", "all_reduce") + starts(bars, "communication", "reduce_scatter")
        assert any(backward_start < start < backward_end for start in reductions), rank


def test_tensor_parallel_communicates_inside_every_forward_and_backward_layer(timelines):
    for rank, bars in timelines["06"].items():
        backward_start, backward_end = min(starts(bars, "backward")), max(ends(bars, "backward"))
        collectives = starts(bars, "communication")
        # 4 layers, each with collectives before and after its attention and its MLP
        assert len([start for start in collectives if start < backward_start]) >= 8, rank
        assert len([start for start in collectives if backward_start < start < backward_end]) >= 8, rank


def test_each_pipeline_stage_waits_for_the_other_one(timelines):
    first_stage, last_stage = timelines["08"][0], timelines["08"][1]
    # the last stage's first backward needs the first stage's activations; the first stage's needs its gradient
    assert min(starts(last_stage, "communication", "recv")) < min(starts(last_stage, "backward"))
    assert min(starts(last_stage, "backward")) < min(starts(first_stage, "backward"))
    assert min(starts(first_stage, "communication", "recv")) < min(starts(first_stage, "backward"))
    # (a send's annotation ends when its sender waits for it, which may be later: the receives are the proof)


def test_the_bubble_is_each_ranks_share_of_the_pipeline_without_forward_or_backward():
    # the pipeline spans 0-40 ms; rank 1's overlapping bars count once, the optimizer's not at all
    bars = {0: [("compute", "forward", 0, 10, "aten::mm"), ("compute", "backward", 30, 10, "aten::mm"),
                ("compute", "optimizer", 40, 50, "aten::add_"),
                ("communication", "communication", 10, 20, "gloo:recv")],
            1: [("compute", "forward", 10, 20, "aten::mm"), ("compute", "backward", 20, 10, "aten::mm")]}
    assert TIMELINE["bubble"](bars) == {0: 0.5, 1: 0.5}
    with pytest.raises(SystemExit, match="on a GPU only launch kernels"):
        TIMELINE["bubble"]({**bars, 1: [*bars[1], ("gpu kernels", "gpu kernels", 10, 5, "gemm")]})


def test_every_pipeline_rank_idles_for_part_of_the_step(timelines):
    # 2 stages, 4 micro-batches: the bubble formula's (p - 1) / (m + p - 1) = 20%, plus the gaps between the
    # tiny model's operators (measured here: 44% and 57%), never the whole span
    idle = TIMELINE["bubble"](timelines["08"])
    assert all(0.1 < share < 0.9 for share in idle.values()), idle
