"""Every chapter's validation loss is chapter 01's on the same weights: the same held-out rows, each counted
once over the ranks (data-parallel slices, tensor-parallel shards, pipeline stages, sequence chunks, experts),
averaged over all their label tokens."""
import pytest

from conftest import load_weights, run_chapter, with_model

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
    "11": (4, ["-b", 2, "--ep", 2]),
}
# fp32 rounding of the sums in another order: the loss is about 5.6, where one float32 step is 4.8e-7.
VAL_LOSS_TOLERANCE = 1e-6


@pytest.mark.parametrize("chapter", LAYOUTS)
def test_val_loss_equals_chapter_01s_on_the_same_weights(chapter, common_args, model_for, launch_once, tmp_path):
    nproc, flags = LAYOUTS[chapter]
    model = model_for(chapter)
    args = with_model([*common_args, *FROZEN], model)
    chapter_01 = launch_once("01", [*args, "-b", 8])
    run = run_chapter(chapter, [*args, *flags], tmp_path, nproc=nproc)
    # The premise: neither run moved a weight, so both evaluated the model on disk.
    start = load_weights(model)
    for finished in (run, chapter_01):
        weights = load_weights(finished.exp_dir / "hf")
        assert all(weights[name].equal(start[name]) for name in start)
    ours, theirs = run.metrics[-1], chapter_01.metrics[-1]
    assert ours["step"] == theirs["step"] == 1
    assert abs(ours["val_loss"] - theirs["val_loss"]) < VAL_LOSS_TOLERANCE, (ours, theirs)
