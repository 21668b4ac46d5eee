"""Every chapter's validation loss is chapter 01's on the same weights: the same held-out rows, each counted
once over the ranks (data-parallel slices, tensor-parallel shards, pipeline stages), averaged over all their
label tokens."""
import pytest

from conftest import load_weights, run_chapter

# One step at a learning rate that moves no fp32 weight (1e-30 x an Adam update of about 1, beside weights of
# 1e-2 whose last bit is 1e-9), so the evaluation at the end reads the pretrained weights in every chapter.
FROZEN = ["--max-steps", 1, "--lr", 1e-30]
# (processes, flags) of each chapter, at chapter 01's global batch of 8 (it sets which rows are held out).
LAYOUTS = {
    "02": (2, ["-b", 4]),
    "04": (2, ["-b", 4]),
    "05": (2, ["-b", 4]),
    "06": (2, ["-b", 8]),
    "07": (4, ["-b", 4, "--tp", 2]),
    "08": (2, ["-b", 8]),
    "09": (4, ["-b", 8, "--pp", 2, "--tp", 2]),
    "10": (4, ["-b", 4, "--cp", 2]),
}
# fp32 rounding of the sums in another order: the loss is about 5.6, where one float32 step is 4.8e-7.
VAL_LOSS_TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def chapter_01(common_args, launch_once):
    return launch_once("01", [*common_args, "-b", 8, *FROZEN])


@pytest.mark.parametrize("chapter", LAYOUTS)
def test_val_loss_equals_chapter_01s_on_the_same_weights(chapter, chapter_01, common_args, tiny_model,
                                                         tmp_path):
    nproc, flags = LAYOUTS[chapter]
    run = run_chapter(chapter, [*common_args, *flags, *FROZEN], tmp_path, nproc=nproc)
    # The premise: neither run moved a weight, so both evaluated the model of tiny_model.
    start = load_weights(tiny_model)
    for finished in (run, chapter_01):
        weights = load_weights(finished.exp_dir / "hf")
        assert all(weights[name].equal(start[name]) for name in start)
    ours, theirs = run.metrics[-1], chapter_01.metrics[-1]
    assert ours["step"] == theirs["step"] == 1
    assert abs(ours["val_loss"] - theirs["val_loss"]) < VAL_LOSS_TOLERANCE, (ours, theirs)
