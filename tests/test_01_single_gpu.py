"""Chapter 01: one device. It learns, it resumes exactly after any interruption, it exports a model
Hugging Face loads, and it refuses bad input with one line.

Every comparison here is bitwise: on CPU in fp32 the same program on the same data gives the same bits, so
any difference at all means the resume lost or changed something (a step, the data order, optimizer state,
the LR schedule or an RNG).
"""
import hashlib
import io
import json
import math
import random
import re
import shutil
import signal
import subprocess
import sys

import pytest
import sentencepiece
import torch
import transformers

from conftest import (
    CHAPTERS, INJECT, assert_same_training, inject_env, max_weight_diff, measured, offline_env, online_env,
    run_chapter, wandb_history, write_tiny_model,
)
from launching import without_timing

# NOTE: 8 steps with a checkpoint every 2: long enough to stop in the middle, short enough for a test.
EXACT = ["--max-steps", 8, "--ckpt-freq", 2]


@pytest.fixture
def reference(common_args, launch_once):
    """An uninterrupted 8-step fp32 run: the numbers every interrupted run must reproduce."""
    return launch_once("01", [*common_args, *EXACT], experiment="reference")


@pytest.fixture
def default_run_with_wandb(launch_once):
    """The reader's default (tiny Llama, built-in corpus), 60 steps, logging to an offline wandb run; through
    tests/inject.py, which prints the learning rate each optimizer step applies."""
    return launch_once("01", ["--max-steps", 60, "--log-freq", 1, "--wandb"], experiment="default", script=INJECT,
                       env=inject_env("01", "applied-lr"))


def warmup_then_cosine_by_hand(step, peak, warmup, total):
    """The rate of optimizer step `step` (1 = the first), as the README states the schedule: linear warmup to
    the peak over `warmup` steps, then one cosine from the peak down to a tenth of it at step `total`."""
    if step <= warmup:
        return peak * step / warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - 1 - warmup) / (total - warmup))))


def interrupted(tmp_path, args, what, after_step):
    """Launch the chapter through tests/inject.py, which sends it a real signal or kills it mid-save."""
    return run_chapter("01", args, tmp_path, experiment="interrupted", script=INJECT, expect_ok=False,
                       env=inject_env("01", what, after_step=after_step))


def test_loss_falls_well_below_the_starting_loss(default_run_with_wandb):
    losses = default_run_with_wandb.losses
    assert len(losses) == 60
    # A fresh model guesses uniformly over the 272-token vocabulary: loss ln(272) = 5.6.
    assert abs(losses[0] - math.log(272)) < 0.3, losses[0]
    # Measured: 1.5 at step 60 on the built-in corpus (0.34 after the full 279-step epoch). Half the start
    # leaves room for other machines' arithmetic and still fails if the model does not learn.
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0], losses[-5:]


def test_logged_lr_is_the_one_each_step_used(default_run_with_wandb):
    run = default_run_with_wandb
    applied = {int(step): float(lr) for step, lr in re.findall(r"^rank 0: step (\d+) lr (\S+)$", run.stdout, re.M)}
    assert sorted(applied) == list(range(1, 61))
    # What the log says each step used is what the optimizer applied in that step, to the last bit.
    assert [m["lr"] for m in run.metrics] == [applied[step] for step in range(1, 61)]
    # Default --lr 1e-3 and --warmup-steps 20 over 60 steps: step 1 at 1/20 of the peak, step 20 at the peak.
    for step in range(1, 61):
        assert applied[step] == pytest.approx(warmup_then_cosine_by_hand(step, 1e-3, 20, 60), rel=1e-12), step


def test_wandb_offline_run_logs_every_metric_line(default_run_with_wandb):
    runs = list((default_run_with_wandb.exp_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    logged = wandb_history(runs[0])
    assert [row["_step"] for row in logged] == list(range(1, 61))
    for row, line in zip(logged, default_run_with_wandb.metrics):
        assert {key: row[key] for key in line} == line


def test_sigterm_then_relaunch_continues_bitwise_equal(reference, common_args, tmp_path):
    args = [*common_args, *EXACT]
    stopped = interrupted(tmp_path, args, "sigterm", after_step=3)
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    assert "stopped by a signal after step 3; relaunch the same command to resume" in stopped.stderr
    # The handler lets step 3 finish and checkpoints it, although 3 is not a multiple of --ckpt-freq.
    assert sorted(p.name for p in (stopped.exp_dir / "checkpoints").iterdir()) == ["step-00000002", "step-00000003"]

    resumed = run_chapter("01", args, tmp_path, experiment="interrupted")
    assert "at step 3" in resumed.stdout
    assert resumed.losses == reference.losses
    assert max_weight_diff(resumed.exp_dir / "hf", reference.exp_dir / "hf") == 0


def test_sigkill_during_a_checkpoint_save_resumes_from_the_previous_one(reference, common_args, tmp_path):
    args = [*common_args, *EXACT]
    killed = interrupted(tmp_path, args, "kill-in-save", after_step=2)
    assert killed.returncode == -9, killed.stderr[-3000:]
    checkpoints = killed.exp_dir / "checkpoints"
    # The save of step 4 died with half a file written: only its .partial folder holds it.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000002", "step-00000004.partial"]
    half = (checkpoints / "step-00000004.partial" / "checkpoint.pt").stat().st_size
    assert half < (checkpoints / "step-00000002" / "checkpoint.pt").stat().st_size
    assert len(killed.losses) == 4

    resumed = run_chapter("01", args, tmp_path, experiment="interrupted")
    assert "step-00000002 at step 2" in resumed.stdout
    # Steps 3 and 4 ran twice; metrics.jsonl keeps only the second time, so it reads like one clean run.
    assert without_timing(resumed.metrics) == without_timing(reference.metrics)
    assert max_weight_diff(resumed.exp_dir / "hf", reference.exp_dir / "hf") == 0
    # The newest two are kept: the one before the newest is the fallback if the newest turns out damaged.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000006", "step-00000008"]


def test_exported_hf_model_gives_the_trained_models_logits(reference, tiny_model):
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(reference.exp_dir / "hf", dtype=torch.float32)
    trained = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(tiny_model), dtype=torch.float32
    )
    checkpoint = torch.load(
        reference.exp_dir / "checkpoints" / "step-00000008" / "checkpoint.pt", map_location="cpu", weights_only=True
    )
    trained.load_state_dict(checkpoint["model"])
    input_ids = transformers.AutoTokenizer.from_pretrained(reference.exp_dir / "hf")(
        ["red green blue cat dog", "bird runs sits sings"], padding=True, return_tensors="pt"
    ).input_ids
    with torch.no_grad():
        assert torch.equal(hf_model(input_ids).logits, trained.eval()(input_ids).logits)
    # ... and it is the trained model, not the starting weights.
    assert max_weight_diff(reference.exp_dir / "hf", tiny_model) > 1e-3


def test_under_torchrun_with_several_processes_it_stops_with_one_line(common_args, tmp_path):
    """Two copies of a one-process script would each train the whole model into the same checkpoints. (The rank
    that gets there first exits, and torchrun then stops the other, which may not have printed its line yet.)"""
    run = run_chapter("01", [*common_args, "--max-steps", 2], tmp_path, nproc=2, expect_ok=False, timeout=120)
    lines = re.findall(r"error: this script trains in one process: run it with python \(chapter 02's runs "
                       r"under torchrun\)\n", run.worker_stderr)
    assert run.returncode != 0 and lines, run.stderr[-3000:]
    assert not (run.exp_dir / "checkpoints").exists()


def test_a_model_with_only_a_sentencepiece_tokenizer_trains(common_args, tiny_dataset, tmp_path):
    """Llama 2 era repositories ship tokenizer.model without a tokenizer.json; transformers converts it with the
    sentencepiece package (in requirements.txt), and without it the script stops at the tokenizer."""
    model = write_tiny_model(tmp_path / "sentencepiece-llama", vocab_size=64)
    for path in model.iterdir():
        if path.name != "config.json" and not path.name.endswith(".safetensors"):
            path.unlink()
    spm_model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter((tiny_dataset / "part-0.txt").read_text().splitlines()), model_writer=spm_model,
        vocab_size=64, model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
    )
    (model / "tokenizer.model").write_bytes(spm_model.getvalue())
    (model / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer", "eos_token": "</s>"}')
    run = run_chapter("01", [*common_args, "-m", model, "--max-steps", 2], tmp_path)
    assert [m["step"] for m in run.metrics] == [1, 2] and all(math.isfinite(loss) for loss in run.losses)


def small_dataset(tmp_path):
    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "one.txt").write_text("far too short for a batch of 8 rows of 33 tokens\n")
    return tmp_path / "small"


def a_path_under_a_file(tmp_path):
    (tmp_path / "a-file").write_text("")
    return tmp_path / "a-file" / "outputs"


# name: (flags after common_args, or a function of tmp_path giving them; the line the user must see)
BAD_INPUTS = {
    "unknown-model": (["-m", "no-such-org/no-such-model"], "error: cannot load model 'no-such-org/no-such-model'"),
    "unknown-dataset": (["-d", "no-such-org/no-such-dataset"],
                        "error: cannot load dataset 'no-such-org/no-such-dataset'"),
    "dataset-smaller-than-a-batch": (lambda tmp: ["-d", small_dataset(tmp)], "fewer than one batch of 8"),
    "seq-length-beyond-positions": (["-s", 300], "-s/--seq-length 300 is longer than"),
    "unwritable-save-dir": (lambda tmp: ["--save-dir", a_path_under_a_file(tmp)], "error: cannot write to --save-dir"),
    "zero-log-freq": (["--log-freq", 0], "error: argument --log-freq: 0 is not a positive integer"),
    "negative-lr": (["--lr", -1], "error: argument --lr: -1 is not a positive number"),
    "mistyped-data-file": (["-d", "nosuch.txt"], "argument -d/--dataset-name: no such file or folder: 'nosuch.txt'"),
    "mistyped-model-folder": (["-m", "./nosuch"], "argument -m/--model-name: no such file or folder: './nosuch'"),
    # datasets' reason, with its cause (what failed to parse), in the line that names the file
    "empty-data-file": (lambda tmp: ["-d", write(tmp / "empty.txt", b"")], "empty.txt' (An error occurred while"),
    "binary-data-file": (lambda tmp: ["-d", write(tmp / "data.txt", bytes(range(128, 256)))],
                         "data.txt' (An error occurred while generating the dataset: 'utf-8' codec can't decode"),
    "no-text-in-any-row": (lambda tmp: ["-d", write(tmp / "data.jsonl", b'{"text": ""}\n' * 50)],
                           "the dataset gives 0 training sequences"),
    # ByT5's 259 tokens into 200 embeddings: a tokenizer that does not belong to the model
    "tokenizer-beyond-the-embedding": (lambda tmp: ["-m", write_tiny_model(tmp / "small-vocab", vocab_size=200)],
                                       "has 259 tokens, more than the model's 200 embeddings"),
}


def write(path, content):
    path.write_bytes(content)
    return path


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_fails_fast_with_one_line(case, common_args, tmp_path):
    flags, message = BAD_INPUTS[case]
    flags = flags(tmp_path) if callable(flags) else flags
    # Online, as a reader is: a mistyped path must fail at once, not after the Hub's retries.
    with measured() as cost:
        run = run_chapter("01", [*common_args, *flags], tmp_path, expect_ok=False, timeout=180,
                          env=online_env() if case.startswith("mistyped") else None)
    assert_fails_with_one_line(run, message, cost)
    # the checks come before anything is written: no outputs/<name>/ of a run that never started
    assert not run.exp_dir.exists()


# name: (flags that differ from the reference run's, or a function of tmp_path giving them; the line expected)
RESUME_CHANGES = {
    "another-model": (lambda tmp: ["-m", write_tiny_model(tmp / "wider", hidden_size=128)],
                      "holds a different model (lm_head.weight: [272, 64] in the checkpoint, [272, 128] now)"),
    # the saved data position would point into other rows, or another order
    "other-rows": (["-s", 16], "continues only under the flags it was trained with (--seq-length: 32 in the "
                               "checkpoint, 16 now); relaunch with those"),
    "another-order": (["--seed", 1], "(--seed: 0 in the checkpoint, 1 now)"),
    # the saved schedule would keep the old peak learning rate
    "another-lr": (["--lr", 0.002], "(--lr: 0.001 in the checkpoint, 0.002 now)"),
    # nothing left to train, and no export: it would end with status 0 having done nothing
    "fewer-steps": (["--max-steps", 4],
                    "is at step 8, past the last step of this run (4); pass a larger --max-steps"),
    # the same command again: the run has finished and exported, so there is nothing to do
    "finished": ([], "is at step 8, the last of this run, which has finished (its model is in "),
}


@pytest.mark.parametrize("case", RESUME_CHANGES)
def test_resuming_with_another_model_or_data_fails_and_keeps_the_checkpoint(case, reference, common_args,
                                                                            tmp_path):
    shutil.copytree(reference.exp_dir, tmp_path / "outputs" / "reference")
    checkpoint = tmp_path / "outputs" / "reference" / "checkpoints" / "step-00000008" / "checkpoint.pt"
    before = hashlib.sha256(checkpoint.read_bytes()).hexdigest()
    flags, message = RESUME_CHANGES[case]
    flags = flags(tmp_path) if callable(flags) else flags
    with measured() as cost:
        run = run_chapter("01", [*common_args, *EXACT, *flags], tmp_path, experiment="reference",
                          expect_ok=False, timeout=180)
    assert_fails_with_one_line(run, message, cost)
    assert hashlib.sha256(checkpoint.read_bytes()).hexdigest() == before
    assert len(run.losses) == 8, "the failed launch must not touch metrics.jsonl"


def test_the_readme_generation_snippet_continues_its_prompt_from_the_export(tmp_path):
    """The last step a reader wants: load the exported model and generate. The snippet must keep the default
    byte tokenizer from appending </s> to the prompt (it would start a new document)."""
    snippet = re.search(r"### Export\n.*?```python\n(.*?)```", (CHAPTERS["01"] / "README.md").read_text(),
                        re.DOTALL)[1]
    prompt = re.search(r'tokenizer\("([^"]+)"', snippet)[1]
    run_chapter("01", ["--max-steps", 2, "--warmup-steps", 1], tmp_path, experiment="default")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "outputs" / "default" / "hf")
    assert tokenizer(prompt).input_ids[-1] == tokenizer.eos_token_id, "the NOTE's reason no longer holds"
    generated = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=offline_env(tmp_path),
                               capture_output=True, text=True, timeout=120)
    assert generated.returncode == 0, generated.stderr[-3000:]
    assert generated.stdout.startswith(prompt) and len(generated.stdout.rstrip("\n")) > len(prompt)


def test_a_finished_run_stopped_before_its_export_exports_when_relaunched(reference, common_args, tmp_path):
    shutil.copytree(reference.exp_dir, tmp_path / "outputs" / "reference")
    shutil.rmtree(tmp_path / "outputs" / "reference" / "hf")
    run = run_chapter("01", [*common_args, *EXACT], tmp_path, experiment="reference")
    assert run.losses == reference.losses, "nothing trains again"
    assert max_weight_diff(run.exp_dir / "hf", reference.exp_dir / "hf") == 0


def test_a_relaunch_with_more_steps_trains_on_over_the_stretched_schedule(reference, common_args, tmp_path):
    """--max-steps may grow on resume (it is not a fixed flag): steps 9-10 train. Step 9 runs at the learning rate
    the checkpoint's schedule set for it (the floor of the 8-step cosine), step 10 on the cosine over the new total
    of 10 steps (peak --lr 1e-3, --warmup-steps 2 in common_args)."""
    shutil.copytree(reference.exp_dir, tmp_path / "outputs" / "reference")
    run = run_chapter("01", [*common_args, *EXACT, "--max-steps", 10], tmp_path, experiment="reference")
    assert [m["step"] for m in run.metrics] == list(range(1, 11))
    assert run.losses[:8] == reference.losses
    assert run.metrics[8]["lr"] == pytest.approx(warmup_then_cosine_by_hand(9, 1e-3, 2, 8), rel=1e-12) == 1e-4
    assert run.metrics[9]["lr"] == pytest.approx(warmup_then_cosine_by_hand(10, 1e-3, 2, 10), rel=1e-12)
    assert run.metrics[9]["lr"] > run.metrics[8]["lr"]


def assert_fails_with_one_line(run, message, cost):
    assert run.returncode != 0
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    last_line = run.stderr.strip().splitlines()[-1]
    # argparse's mistakes too: one line, without its usage block
    assert message in last_line and last_line.startswith("error: ") and "usage:" not in run.stderr, (
        run.stderr[-3000:]
    )
    # NOTE: each of these fails right after loading the config: ~4 s of CPU (imports, mostly). Wall time
    # depends on the machine's load (4 s idle, up to 74 s measured with four other test suites running), so
    # the bound on it only catches retry loops and waits; the CPU bound catches any real work done.
    assert cost["cpu"] < 20, f"used {cost['cpu']:.0f} CPU seconds to fail"
    assert cost["wall"] < 150, f"took {cost['wall']:.0f} s to fail"


def test_a_stop_between_log_steps_logs_each_step_once_across_the_resume(common_args, launch_once, tmp_path):
    """Stopped after step 5, between log steps (chapter 01 stops at once): the stop's own line logs step 5 and
    its checkpoint keeps no losses, so the resumed run's step-6 line logs step 6 alone. Together they give the
    mean of the uninterrupted run's step-6 line (steps 5 and 6); every other line is the uninterrupted run's."""
    args = [*common_args, "--max-steps", 8, "--ckpt-freq", 4, "--log-freq", 3, "--eval-freq", 1000]
    uninterrupted = launch_once("01", args)
    assert [m["step"] for m in uninterrupted.metrics] == [3, 4, 6, 8]  # (a checkpoint step logs too)
    stopped = interrupted(tmp_path, args, "sigterm", after_step=5)
    assert stopped.returncode == 1
    resumed = run_chapter("01", args, tmp_path, experiment="interrupted")
    by_step = {m["step"]: m for m in without_timing(resumed.metrics)}
    expected = {m["step"]: m for m in without_timing(uninterrupted.metrics)}
    assert list(by_step) == [3, 4, 5, 6, 8]
    assert [by_step[step] for step in (3, 4, 8)] == [expected[step] for step in (3, 4, 8)]
    assert (by_step[5]["loss"] + by_step[6]["loss"]) / 2 == pytest.approx(expected[6]["loss"], rel=1e-6)


def test_ctrl_c_stops_like_sigterm_a_relaunch_continues_bitwise_and_a_second_one_stops_at_once(
    reference, common_args, tmp_path
):
    args = [*common_args, *EXACT]
    stopped = interrupted(tmp_path, args, "sigint", after_step=3)
    assert stopped.returncode == 1 and "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    assert stopped.stderr.strip().splitlines()[-1] == (
        "stopped by a signal after step 3; relaunch the same command to resume"
    )
    assert (stopped.exp_dir / "checkpoints" / "step-00000003").is_dir()
    resumed = run_chapter("01", args, tmp_path, experiment="interrupted")
    assert "at step 3" in resumed.stdout
    assert without_timing(resumed.metrics) == without_timing(reference.metrics)
    assert max_weight_diff(resumed.exp_dir / "hf", reference.exp_dir / "hf") == 0
    twice = run_chapter("01", args, tmp_path, experiment="twice", script=INJECT, expect_ok=False,
                        env=inject_env("01", "sigint-twice", after_step=3))
    # The second Ctrl-C ends the process at once (killed by SIGINT), before step 3 is saved.
    assert twice.returncode == -signal.SIGINT and "Traceback" not in twice.stderr, twice.stderr[-3000:]
    assert not (twice.exp_dir / "checkpoints" / "step-00000003").exists()


def test_a_run_that_is_mostly_warmup_says_so(common_args, launch_once):
    warned = launch_once("01", [*common_args, "--max-steps", 4, "--warmup-steps", 3])
    assert ("warning: --warmup-steps 3 covers most of the 4 steps, so the learning rate hardly decays; pass "
            "--warmup-steps 1 or train longer") in warned.stderr
    assert "warning: --warmup-steps" not in launch_once("01", [*common_args, *EXACT]).stderr


def damage(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damaged_file", ["checkpoint.pt", "state.json"])
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_previous_one_resumes(
    damaged_file, reference, common_args, tmp_path
):
    args = [*common_args, *EXACT]
    stopped = interrupted(tmp_path, args, "sigterm", after_step=5)
    checkpoints = stopped.exp_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000004", "step-00000005"]
    damage(checkpoints / "step-00000005" / damaged_file)

    resumed = run_chapter("01", args, tmp_path, experiment="interrupted")
    # (the library's own error names what failed: torch.load's for checkpoint.pt, json's for state.json)
    assert re.search(r"warning: checkpoint \S+step-00000005 fails to load \(\w+: [^\n]+\); set it aside as "
                     r"step-00000005.damaged", resumed.stderr)
    assert "step-00000004 at step 4" in resumed.stdout
    assert resumed.losses == reference.losses
    # set aside, never deleted
    assert (checkpoints / "step-00000005.damaged" / damaged_file).exists()


def without_format(checkpoint):
    state_file = checkpoint / "state.json"
    state = json.loads(state_file.read_text())
    del state["checkpoint_format"]
    state_file.write_text(json.dumps(state))


# name: (what is done to the newest checkpoint, what the run then prints) -- neither is a damaged file
NOT_DAMAGE = {
    # written before state.json recorded the format: one line
    "older-script": (without_format, "error: checkpoint [^\n]*step-00000005 is an older script's, this script's "
                                     "are one file; resume it with the script that wrote it, or pass a new -e"),
    # a checkpoint.pt that holds something else (or a bug in load_checkpoint): its traceback
    "other-contents": (lambda checkpoint: torch.save({"something": "else"}, checkpoint / "checkpoint.pt"),
                       "KeyError: 'model'"),
}


@pytest.mark.parametrize("case", NOT_DAMAGE)
def test_a_load_that_fails_for_a_reason_other_than_a_damaged_file_sets_nothing_aside(case, common_args, tmp_path):
    change, expected = NOT_DAMAGE[case]
    args = [*common_args, *EXACT]
    checkpoints = interrupted(tmp_path, args, "sigterm", after_step=5).exp_dir / "checkpoints"
    change(checkpoints / "step-00000005")
    run = run_chapter("01", args, tmp_path, experiment="interrupted", expect_ok=False)
    assert re.search(expected, run.stderr), run.stderr[-2000:]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000004", "step-00000005"]


def test_when_no_checkpoint_loads_it_stops_with_one_line_and_sets_each_aside(common_args, tmp_path):
    args = [*common_args, *EXACT]
    stopped = interrupted(tmp_path, args, "sigterm", after_step=5)
    checkpoints = stopped.exp_dir / "checkpoints"
    for name in ("step-00000004", "step-00000005"):
        damage(checkpoints / name / "checkpoint.pt")
    with measured() as cost:
        run = run_chapter("01", args, tmp_path, experiment="interrupted", expect_ok=False)
    assert_fails_with_one_line(run, f"error: no checkpoint in {checkpoints} loads (each is now *.damaged)", cost)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000004.damaged", "step-00000005.damaged"]


def test_max_steps_beyond_one_epoch_trains_that_many_steps(common_args, launch_once):
    """As in Hugging Face's Trainer, --max-steps wins over --num-epochs (default 1): the tiny data set packs into
    718 rows, 64 of which (1%, rounded up to a global batch) are held out for validation, so an epoch is 10 steps
    of 64 and 15 steps run into a second epoch instead of stopping after 10."""
    run = launch_once("01", [*common_args, "-b", 64, "--max-steps", 15])
    assert "global batch: 64 sequences (-b 64 x 1 micro-batches); 64 validation rows" in run.stdout
    assert [m["step"] for m in run.metrics] == list(range(1, 16))
    assert [m["epoch"] for m in run.metrics] == [0] * 10 + [1] * 5


def test_k_micro_batches_of_b_train_as_one_batch_of_k_times_b(reference, common_args, launch_once):
    """-b 2 --grad-accum-steps 4: four backwards, their gradients added up, one optimizer step; the same numbers
    as the reference's one batch of 8 at every step, its validation losses included (fp32: to rounding)."""
    accumulated = launch_once("01", [*common_args, *EXACT, "-b", 2, "--grad-accum-steps", 4])
    assert "global batch: 8 sequences (-b 2 x 4 micro-batches); 8 validation rows" in accumulated.stdout
    # (a validation loss at each checkpoint, every 2 steps, and at the end)
    assert [m["step"] for m in reference.metrics if "val_loss" in m] == [2, 4, 6, 8]
    assert_same_training(accumulated, reference, 8)


def test_with_masked_prompts_the_loss_is_the_mean_over_label_tokens_not_over_micro_batches(
    common_args, launch_once, prompted_dataset
):
    """With a prompt column, prompt tokens get label -100: micro-batches hold different numbers of label tokens
    (counted here from what the loss was computed on), so the mean of each micro-batch's mean over K would
    weigh their tokens unequally. Summing token losses over the global batch's count keeps K=4 x -b 2 equal to
    one batch of 8."""
    args = [*common_args, "-d", prompted_dataset, "--max-steps", 4]
    whole = launch_once("01", args)
    accumulated = launch_once("01", [*args, "-b", 2, "--grad-accum-steps", 4], script=INJECT,
                              env=inject_env("01", "label-counts"))
    counts = json.loads(re.search(r"^rank 0: label_counts (.*)$", accumulated.stdout, re.MULTILINE)[1])
    first_step = counts[:4]
    assert len(set(first_step)) > 1 and max(first_step) < 2 * 32, first_step  # masked, and unequal
    assert_same_training(accumulated, whole, 4)


def write_random_words(path, documents, seed):
    """Documents of words in random order, so no two packed rows hold the same tokens (the shared corpus
    repeats its phrases)."""
    rng = random.Random(seed)
    words = ["red", "green", "blue", "cat", "dog", "bird", "runs", "sits", "sings", "fast", "slow", "here"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(" ".join(rng.choices(words, k=12)) + ".\n" for _ in range(documents)))
    return path


def rows_read(run):
    """The rows the model read in training and in evaluation, and the number of validation rows it printed."""
    rows = json.loads(re.search(r"^rank 0: rows (.*)$", run.stdout, re.MULTILINE)[1])
    held_out = re.search(r"; (\d+|no) validation rows", run.stdout)[1]
    return rows, 0 if held_out == "no" else int(held_out)


def test_validation_rows_are_never_trained_on(common_args, tmp_path):
    data = write_random_words(tmp_path / "data" / "part-0.txt", 600, seed=0).parent
    args = [*common_args, "-d", data, *EXACT, "--eval-freq", 2]
    rows, held_out = rows_read(run_chapter("01", args, tmp_path, script=INJECT, env=inject_env("01", "rows")))
    # 8 steps of 8 distinct rows; the same validation rows (whole global batches) read at each of 4 evaluations
    assert len(rows["train"]) == len(set(rows["train"])) == 64
    assert held_out % 8 == 0 and len(rows["eval"]) == 4 * held_out and len(set(rows["eval"])) == held_out
    assert not set(rows["train"]) & set(rows["eval"])


def test_a_datasets_validation_split_is_the_validation_rows(common_args, tmp_path):
    data = tmp_path / "data"
    write_random_words(data / "train.txt", 600, seed=0)
    write_random_words(data / "validation.txt", 200, seed=1)
    rows, validation_rows = rows_read(run_chapter("01", [*common_args, "-d", data, *EXACT], tmp_path,
                                                  script=INJECT, env=inject_env("01", "rows")))
    # the oracle: the validation file alone, one epoch at -b 1 trains on each of its packed rows once
    alone, none_held_out = rows_read(run_chapter(
        "01", [*common_args, "-d", data / "validation.txt", "-b", 1, "--val-fraction", 0, "--num-epochs", 1],
        tmp_path, experiment="alone", script=INJECT, env=inject_env("01", "rows")))
    assert none_held_out == 0 and len(alone["train"]) == len(set(alone["train"]))
    # all of the split's rows but those that do not fill a global batch of 8, and none held out of train.txt
    assert validation_rows == len(alone["train"]) // 8 * 8 > 8
    assert set(rows["eval"]) <= set(alone["train"]) and len(set(rows["eval"])) == validation_rows
    assert not set(rows["train"]) & set(alone["train"])


def test_a_relaunch_may_change_micro_batches_and_k_at_the_same_global_batch_but_not_the_global_batch(
    reference, common_args, tmp_path
):
    args = [*common_args, *EXACT]
    stopped = interrupted(tmp_path, args, "sigterm", after_step=3)
    assert stopped.returncode == 1
    resumed = run_chapter("01", [*args, "-b", 4, "--grad-accum-steps", 2], tmp_path, experiment="interrupted")
    assert "at step 3" in resumed.stdout
    assert_same_training(resumed, reference, 8)
    with measured() as cost:
        refused = run_chapter("01", [*args, "-b", 4, "--max-steps", 10], tmp_path, experiment="interrupted",
                              expect_ok=False)
    assert_fails_with_one_line(
        refused, "(--global-batch-size: 8 in the checkpoint, 4 now); relaunch with "
        "those", cost)
