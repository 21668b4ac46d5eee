"""A model whose weights cannot be loaded, a model the parallel plans are not written for, a tokenizer with more
tokens than the model has embeddings, a checkpoint of the other format under the same -e, one resumed on
other data, training that diverges (a NaN loss), or a full disk stops every chapter the same way: one line on
every rank (that meets the problem) that names the problem and the fix, a non-zero exit within seconds, no
traceback from the script, no gloo error from a rank left waiting in a collective."""
import os
import re
import shutil
import subprocess
import time

import pytest

from conftest import INJECT, inject_env, missing_system_tool, run_chapter, write_tiny_model

# chapter: processes (None: plain python), for the chapters that load weights their own way; 06-09 load them with
# chapter 02's build_model, the same text (tests/test_chapter_diffs.py).
LOADING_CHAPTERS = {"01": None, "02": 2, "04": 2, "05": 2}


@pytest.fixture(scope="module")
def model_without_weights(tiny_model, tmp_path_factory):
    """A model folder with its config and tokenizer but no weights file: --from-pretrained cannot load it."""
    folder = tmp_path_factory.mktemp("no-weights")
    for path in tiny_model.iterdir():
        if not path.name.endswith((".safetensors", ".bin")):
            shutil.copy(path, folder / path.name)
    return folder


@pytest.mark.parametrize("chapter", LOADING_CHAPTERS)
def test_missing_pretrained_weights_give_every_rank_one_line(chapter, model_without_weights, tmp_path):
    nproc = LOADING_CHAPTERS[chapter]
    started = time.monotonic()
    run = run_chapter(chapter, ["-m", model_without_weights, "--from-pretrained", "--max-steps", 2], tmp_path,
                      nproc=nproc, expect_ok=False, timeout=120)
    assert time.monotonic() - started < 60
    # The line says what to do, not only what went wrong.
    assert_every_rank_prints_one_line(run, rf"error: [^\n]*{re.escape(repr(str(model_without_weights)))}[^\n]*"
                                           r"; (?:pass|download|leave)[^\n]*", nproc or 1)
    assert not (tmp_path / "outputs" / "test" / "checkpoints").exists()


def assert_every_rank_prints_one_line(run, pattern, nproc=2):
    """The run failed with one line matching pattern on each of its ranks, the same on all, and without a
    traceback from the script or a gloo error from a rank left waiting in a collective."""
    assert run.returncode != 0
    lines = re.findall(pattern, run.worker_stderr)
    assert len(lines) == nproc and len(set(lines)) == 1, run.stderr[-3000:]
    assert 'train_llm.py", line' not in run.stderr and "gloo" not in run.stderr, run.stderr[-3000:]


# the saved data position counts rows of -s + 1 tokens: under another -s it would skip or repeat data
OTHER_ROWS = (r"error: checkpoint [^\n]*step-00000002 continues only under the flags it was trained with "
              r"\(--seq-length: 32 in the checkpoint, 16 now\); relaunch [^\n]*")
# chapters 01-02 write one file, 04-09 shard it with DCP
OTHER_FORMAT = r"error: checkpoint [^\n]*step-00000002 is {}, this script's are {}; [^\n]*-e/--experiment-name"
# name: (the chapter that writes a checkpoint at step 2, its layout flags, the chapter that resumes it, the flags
# that resumption changes, the line every rank must print)
UNRESUMABLE = {
    "one-file-into-dcp": ("02", [], "04", [], OTHER_FORMAT.format("one file", r"sharded \(DCP\)")),
    "dcp-into-one-file": ("04", [], "02", [], OTHER_FORMAT.format(r"sharded \(DCP\)", "one file")),
    "other-rows-02": ("02", [], "02", ["-s", 16], OTHER_ROWS),
    "other-rows-09": ("09", ["--pp", 2, "--tp", 1], "09", ["-s", 16], OTHER_ROWS),
    "fewer-steps-04": ("04", [], "04", ["--max-steps", 1],
                       r"error: checkpoint [^\n]*step-00000002 is at step 2, past the last step of this run "
                       r"\(1\); [^\n]*"),
    # the same command after the run finished (a reader's next command reusing the default -e)
    "finished-10": ("10", ["--cp", 2], "10", [],
                    r"error: checkpoint [^\n]*step-00000002 is at step 2, the last of this run, which has finished "
                    r"\(its model is in [^\n]*hf\); pass a larger --max-steps [^\n]*-e/--experiment-name for a new run"),
}


@pytest.mark.parametrize("case", UNRESUMABLE)
def test_a_checkpoint_that_cannot_continue_gives_every_rank_one_line_and_stays_untouched(case, launch_once,
                                                                                         tiny_model, tmp_path):
    writer, layout, reader, changed_flags, pattern = UNRESUMABLE[case]
    args = ["-m", tiny_model, "-s", 32, "--max-steps", 2, "--ckpt-freq", 2, "--dtype", "float32", *layout]
    shutil.copytree(launch_once(writer, args, nproc=2, timeout=180).exp_dir, tmp_path / "outputs" / "test")
    checkpoints = tmp_path / "outputs" / "test" / "checkpoints"
    before = sorted((path.name, path.stat().st_size) for path in checkpoints.rglob("*"))
    assert before, "the first run left no checkpoint"
    run = run_chapter(reader, [*args, *changed_flags], tmp_path, nproc=2, expect_ok=False, timeout=120)
    assert_every_rank_prints_one_line(run, pattern)
    assert sorted((path.name, path.stat().st_size) for path in checkpoints.rglob("*")) == before


# chapter: the flags that put 2 ranks into its layout
LAYOUT_FLAGS = {"06": [], "07": ["--tp", 2], "08": [], "09": ["--pp", 2, "--tp", 1]}


@pytest.mark.parametrize("chapter", LAYOUT_FLAGS)
def test_a_model_outside_the_llama_layout_gives_every_rank_one_line(chapter, tmp_path):
    """Tensor-parallel plans and pipeline splits name Llama's modules; GPT-NeoX has others (embed_in, ...)."""
    model = write_tiny_model(tmp_path / "gpt-neox", architecture="gpt_neox")
    run = run_chapter(chapter, ["-m", model, "--max-steps", 2, *LAYOUT_FLAGS[chapter]], tmp_path, nproc=2,
                      expect_ok=False, timeout=120)
    assert_every_rank_prints_one_line(run, r"error: the (?:tensor-parallel plan|pipeline split) is written for "
                                           r"the Llama family [^\n]*GPTNeoXForCausalLM[^\n]*; use such a model")


def test_weights_that_transformers_converts_while_loading_stop_chapter_05_with_one_line(tmp_path):
    """Chapter 05 reads each weight's rows from the files by the name the model gives it; Mixtral's files keep one
    tensor per expert, which transformers fuses into one while loading (chapter 04 loads it that way)."""
    model = write_tiny_model(tmp_path / "mixtral", architecture="mixtral", num_local_experts=2,
                             num_experts_per_tok=1)
    run = run_chapter("05", ["-m", model, "--from-pretrained", "-s", 32, "--max-steps", 1], tmp_path, nproc=2,
                      expect_ok=False, timeout=120)
    assert_every_rank_prints_one_line(run, r"error: [^\n]*mixtral' has no tensor model\.layers\.0\.mlp\.[^\n]*"
                                           r"renames or fuses them while loading[^\n]*only chapter 04 reads")


def test_a_tokenizer_beyond_the_embedding_gives_every_rank_one_line(tmp_path):
    """Token ids past the embedding would fail in the forward (a device-side assert on CUDA): caught first."""
    model = write_tiny_model(tmp_path / "small-vocab", vocab_size=200)
    run = run_chapter("02", ["-m", model, "--max-steps", 2], tmp_path, nproc=2, expect_ok=False, timeout=120)
    assert_every_rank_prints_one_line(run, r"error: the tokenizer of [^\n]* has 259 tokens, more than the model's "
                                           r"200 embeddings; pass [^\n]*")


# chapter: (processes, layout flags, the rank whose weights turn NaN after step 3, --log-freq). With --log-freq 1
# the step-4 log line finds the NaN loss; with 10 the step-4 checkpoint's log line (every checkpoint step logs).
DIVERGING = {
    "01": (None, [], 0, 1),
    "02": (2, [], 1, 10),
    "04": (2, [], 0, 1),
    "06": (2, [], 1, 10),
    "08": (2, [], 0, 1),
    "09": (2, ["--pp", 2, "--tp", 1], 1, 10),
}


@pytest.mark.parametrize("chapter", DIVERGING)
def test_diverged_training_stops_every_rank_before_a_checkpoint_keeps_it(chapter, common_args, tmp_path):
    nproc, layout, nan_rank, log_freq = DIVERGING[chapter]
    args = [*common_args, *layout, "--max-steps", 8, "--ckpt-freq", 2, "--log-freq", log_freq]
    run = run_chapter(chapter, args, tmp_path, nproc=nproc, expect_ok=False, timeout=120, script=INJECT,
                      env=inject_env(chapter, "nan", rank=nan_rank, after_step=3))
    assert_every_rank_prints_one_line(
        run, r"error: training diverged at step 4 \(loss nan, gradient norm nan\) and no checkpoint holds it; "
        r"train again with a lower --lr under a new -e[^\n]*", nproc=nproc or 1)
    assert sorted(path.name for path in (run.exp_dir / "checkpoints").iterdir()) == ["step-00000002"]
    # step 2 logs its validation loss with the checkpoint, whatever --log-freq says
    assert [m["step"] for m in run.metrics] == ([1, 2, 3] if log_freq == 1 else [2])
    assert "val_loss" in run.metrics[1 if log_freq == 1 else 0]


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB file system of its own (a tmpfs), so that a test can fill it."""
    folder = tmp_path / "small-disk"
    folder.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", folder]).returncode:
        missing_system_tool("needs root to mount a small tmpfs (CI runs as root)")
    yield folder
    subprocess.run(["umount", "--lazy", folder], check=True)


# chapter: processes
FULL_DISK = {"01": None, "02": 2, "04": 2}


@pytest.mark.parametrize("chapter", FULL_DISK)
def test_a_full_disk_stops_with_one_line_and_a_relaunch_resumes(chapter, common_args, small_disk, tmp_path):
    nproc = FULL_DISK[chapter]
    args = [*common_args, "--max-steps", 6, "--ckpt-freq", 2, "--save-dir", small_disk]
    env = {**inject_env(chapter, "fill-disk", rank=0, after_step=3), "INJECT_FILL_DIR": str(small_disk)}
    run = run_chapter(chapter, args, tmp_path, nproc=nproc, expect_ok=False, timeout=120, script=INJECT, env=env)
    pattern = (r"error: the disk is full \(\[Errno 28\] No space left on device[^\n]*\); free space under "
               r"--save-dir or pass another, then relaunch the same command \(the last complete checkpoint is "
               r"intact\)")
    # 02's rank 0 writes alone, and its failure reaches the other rank (stop_all_ranks_if_one_fails); 04's
    # ranks all write
    assert_every_rank_prints_one_line(run, pattern, nproc=nproc or 1)
    checkpoints = small_disk / "test" / "checkpoints"
    assert "step-00000002" in os.listdir(checkpoints)

    (small_disk / "filler").unlink()
    resumed = run_chapter(chapter, args, tmp_path, nproc=nproc, timeout=120)
    assert "resumed from" in resumed.stdout and "at step 2" in resumed.stdout
    assert sorted(os.listdir(checkpoints)) == ["step-00000004", "step-00000006"]
