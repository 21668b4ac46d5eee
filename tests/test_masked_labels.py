"""With masked prompts, every chapter's accumulated step is chapter 01's one batch: the loss of a step is the
mean over the label tokens of the whole global batch, counted over all ranks and micro-batches. And every
chapter's validation loss is chapter 01's: the same held-out rows, each counted once over the ranks
(data-parallel slices, tensor-parallel shards, pipeline stages, sequence chunks, experts), averaged over all
their label tokens.

The data is conftest's prompted_dataset: prompt tokens get label -100, so micro-batches hold very different
numbers of label tokens (tests/test_01_single_gpu.py counts them on this data), and the mean of each
micro-batch's or each rank's mean would weigh their tokens unequally. Each chapter runs at chapter 01's global
batch of 8 with at least 2 micro-batches on every rank, and every layout splits the rows, the tokens or the
model as the chapter does: data-parallel ranks, tensor-parallel shards, pipeline stages, sequence chunks,
experts.
"""
import pytest

from conftest import LOSS_TOLERANCE, assert_same_training, with_model

STEPS = 4
# chapter: (processes, flags), each -b x --grad-accum-steps x data-parallel ranks = 8. Chapters 10 and 11 set K
# with --global-batch-size 8 instead: chapter 10 divides it by the dp ranks only (the cp ranks of a dp group
# share rows), chapter 11 by every rank (each rank of an expert group trains rows of its own).
LAYOUTS = {
    "02": (2, ["-b", 2, "--grad-accum-steps", 2]),
    "04": (2, ["-b", 2, "--grad-accum-steps", 2]),
    "05": (2, ["-b", 2, "--grad-accum-steps", 2]),
    "06": (2, ["-b", 4, "--grad-accum-steps", 2]),
    "07": (4, ["-b", 2, "--grad-accum-steps", 2, "--tp", 2]),
    "08": (2, ["-b", 4, "--grad-accum-steps", 2, "--num-microbatches", 2]),
    "09": (4, ["-b", 2, "--grad-accum-steps", 2, "--pp", 2, "--dp", 2, "--tp", 1, "--num-microbatches", 2]),
    "10": (4, ["-b", 2, "--global-batch-size", 8, "--cp", 2]),
    "11": (4, ["-b", 1, "--global-batch-size", 8, "--ep", 2, "--aux-loss-coef", 0]),
}


@pytest.fixture
def runs(common_args, prompted_dataset, model_for, launch_once):
    """runs(chapter): (the chapter's STEPS-step run on its layout, chapter 01's on the same flags), each launched
    once for both tests below."""

    def launch(chapter):
        nproc, flags = LAYOUTS[chapter]
        args = with_model([*common_args, "-d", prompted_dataset, "--max-steps", STEPS], model_for(chapter))
        # On the Llama, chapter 01 with these flags is also test_01's masked-prompt run: launch_once runs it once.
        return launch_once(chapter, [*args, *flags], nproc=nproc), launch_once("01", args)

    return launch


@pytest.mark.parametrize("chapter", LAYOUTS)
def test_with_masked_prompts_accumulated_steps_on_several_ranks_equal_one_batch(chapter, runs):
    assert_same_training(*runs(chapter), STEPS)


@pytest.mark.parametrize("chapter", LAYOUTS)
def test_val_loss_equals_chapter_01s_after_the_same_steps(chapter, runs):
    """The last step evaluates the held-out rows (their prompts masked too) on weights equal to chapter 01's to
    rounding (the test above), so the two validation losses agree to the training losses' tolerance."""
    ours, theirs = (run.metrics[-1] for run in runs(chapter))
    assert ours["step"] == theirs["step"] == STEPS
    assert abs(ours["val_loss"] - theirs["val_loss"]) < LOSS_TOLERANCE, (ours, theirs)
