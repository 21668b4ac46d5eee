"""Chapter 08: a pipeline of stages over the ranks trains the same model to the same numbers as chapter 01 on
one process at the same batch, under each schedule torch offers (GPipe, 1F1B, interleaved 1F1B, interleaved
zero bubble, ZBV, DualPipeV), for a Llama, for a Qwen3 whose embedding is tied to its head (the first and the
last stage each hold a copy) and for a Granite (which scales outside its layers); a run stopped by SIGTERM
resumes to the uninterrupted losses, on the same and on another schedule and split into stages; a layout that
cannot work fails with one line.

Numbers agree to the rounding tolerances of tests/conftest.py (fp32 on CPU).
"""

import re

import pytest
import transformers

from conftest import (
    CHAPTERS, INJECT, ROOT, assert_same_training, assert_tied_copies_equal, inject_env, load_weights, run_chapter,
    stop_then_resume, write_tiny_model,
)
from launching import load_script

TIMELINE = load_script(ROOT / "related-topics" / "profiling" / "timeline.py")

BATCH = 8
STEPS = 10
STOP_AFTER = 4
# (model, schedule, processes): 4 layers make 2 stages of 2 layers, 4 of 1, or (interleaved, V) 2 ranks x 2
# stages. The tied Qwen3 runs where its first and last stage sit on different ranks (1F1B), on ranks that
# hold two stages each (interleaved), and in a V, where rank 0 holds both; GPipe and 1F1B differ only in the
# order of the same work. Granite on 4 stages: hidden states cross 3 stage boundaries, each of which must not
# scale them as Granite scales its embeddings (x12) and logits (measured: losses 0.085 off when they did). On
# 4 ranks each schedule runs once: GPipe over 4 stages of one layer, the others over 8 (an 8-layer Llama, 2
# stages a rank; DualPipeV feeds 8 micro-batches, one a stage).
LAYOUTS = [("llama", "gpipe", 2), ("llama", "interleaved-1f1b", 2), ("qwen3-tied", "1f1b", 2),
           ("qwen3-tied", "interleaved-1f1b", 2), ("llama", "interleaved-zb", 2), ("qwen3-tied", "zbv", 2),
           ("qwen3-tied", "dualpipev", 2), ("granite", "1f1b", 4), ("llama", "gpipe", 4),
           ("llama-8-layers", "interleaved-1f1b", 4), ("llama-8-layers", "interleaved-zb", 4),
           ("llama-8-layers", "zbv", 4), ("llama-8-layers", "dualpipev", 4)]


@pytest.fixture(scope="module")
def models(four_layer_models, tmp_path_factory):
    return {**four_layer_models,
            "llama-8-layers": write_tiny_model(tmp_path_factory.mktemp("llama-8-layers"), num_hidden_layers=8)}


@pytest.fixture
def launch(launch_once, common_args, models):
    """A STEPS-step run, shared across tests: chapter 01 (schedule None) or chapter 08."""

    def launch_layout(model, schedule=None, nproc=None):
        args = [*common_args, "-m", models[model], "--max-steps", STEPS, "-b", BATCH]
        if schedule is None:
            return launch_once("01", args)
        if schedule == "dualpipev":
            args += ["--num-microbatches", 2 * nproc]
        return launch_once("08", [*args, "--schedule", schedule], nproc=nproc)

    return launch_layout


@pytest.mark.parametrize("model,schedule,nproc", LAYOUTS, ids=[f"{m}-{s}-{n}ranks" for m, s, n in LAYOUTS])
def test_pipeline_matches_single_process(launch, model, schedule, nproc):
    single_process = launch(model)
    assert single_process.losses[-1] < single_process.losses[0] - 0.5
    assert min(m["grad_norm"] for m in single_process.metrics) > 1.5
    ours = launch(model, schedule, nproc)
    assert f"rank {nproc - 1}: stages [" in ours.stdout
    assert_same_training(ours, single_process, STEPS)


def test_k_accumulation_steps_multiply_the_micro_batches_of_the_schedule(launch, launch_once, common_args, models):
    """-b 4 x 2: one schedule call of 2 x 4 micro-batches of 1 row (1F1B, 2 stages) trains chapter 01's batch
    of 8."""
    args = [*common_args, "-m", models["llama"], "--max-steps", STEPS, "-b", 4, "--grad-accum-steps", 2,
            "--schedule", "1f1b"]
    ours = launch_once("08", args, nproc=2)
    assert "global batch: 8 sequences (-b 4 x 2), 8 micro-batches in the schedule" in ours.stdout
    assert_same_training(ours, launch("llama"), STEPS)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zbv"])
def test_a_tied_embedding_and_head_stay_one_matrix_on_two_stages(launch, schedule):
    ours = launch("qwen3-tied", schedule, 2)
    assert_tied_copies_equal(ours)
    # HF writes a tied matrix once, as chapter 01's export does.
    assert "lm_head.weight" not in load_weights(ours.exp_dir / "hf")



def test_the_schedule_keeps_no_micro_batch_outputs_after_a_step(common_args, models, tmp_path):
    # By default a schedule keeps each micro-batch's logits on the last stage and joins them: memory the script
    # never reads (4 GB a step for a 1B model at -b 8 -s 2048).
    args = [*common_args, "-m", models["llama"], "--max-steps", 2, "-b", BATCH, "--schedule", "1f1b"]
    run = run_chapter("08", args, tmp_path, nproc=2, script=INJECT, env=inject_env("08", "kept-outputs"))
    for rank in (0, 1):
        assert f"rank {rank}: kept_output_chunks 0 in 1 stages" in run.stdout, run.stdout[-2000:]


def saved_activation_bytes(run):
    return [int(re.search(rf"^rank {rank}: saved_activation_bytes (\d+)$", run.stdout, re.MULTILINE)[1])
            for rank in (0, 1)]


def test_1f1b_holds_fewer_activations_than_gpipe_and_zbv_no_more_than_1f1b(common_args, models,
                                                                          tmp_path_factory):
    """GPipe runs every forward before any backward, so each rank holds all m = 4 micro-batches' activations;
    1F1B's rank r at most p - r (2 on the first stage, 1 on the last). ZBV fills the bubble with postponed
    weight-gradient halves, yet holds about as much as 1F1B's first stage on each rank (Qi et al.). Counted in
    bytes by the saved-activations probe, not timed."""
    held = {}
    for schedule in ("gpipe", "1f1b", "zbv"):
        args = [*common_args, "-m", models["llama"], "--max-steps", 2, "-b", BATCH, "-s", 128,
                "--schedule", schedule]
        run = run_chapter("08", args, tmp_path_factory.mktemp(schedule), nproc=2, script=INJECT,
                          env=inject_env("08", "saved-activations"))
        held[schedule] = saved_activation_bytes(run)
    gpipe, one_f_one_b, zbv = held["gpipe"], held["1f1b"], held["zbv"]
    assert one_f_one_b[0] < 0.6 * gpipe[0] and one_f_one_b[1] < 0.35 * gpipe[1], held
    assert max(zbv) < 1.2 * max(one_f_one_b), held


def test_zbv_idles_less_than_1f1b_on_the_same_layout(common_args, tmp_path_factory):
    """The bubble as related-topics/profiling/timeline.py measures it from a profiled step (2 ranks, m = 4):
    1F1B idles (p - 1) / (m + p - 1) = 20% of the pipeline at best, ZBV close to none. A model whose operators
    outlast the script's overhead between them. Measured on 2 cores: alone, 1F1B 27% and ZBV 16% (ranks
    averaged); beside another test, 1F1B 26-28% and ZBV 17-20%. Load adds idle time to both schedules, so the
    test asserts the ordering and 1F1B's floor, not a ratio."""
    model = write_tiny_model(tmp_path_factory.mktemp("llama-512"), hidden_size=512, intermediate_size=2048,
                             num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8)
    idle = {}
    for schedule in ("1f1b", "zbv"):
        args = [*common_args, "-m", model, "--max-steps", 5, "-b", BATCH, "-s", 128, "--profile",
                "--schedule", schedule]
        run = run_chapter("08", args, tmp_path_factory.mktemp(schedule), nproc=2)
        idle[schedule] = TIMELINE["bubble"](TIMELINE["load_bars"](run.exp_dir / "profile"))
    mean = {schedule: sum(by_rank.values()) / len(by_rank) for schedule, by_rank in idle.items()}
    one_f_one_b_floor = (2 - 1) / (4 + 2 - 1)  # (p - 1) / (m + p - 1)
    assert mean["zbv"] < mean["1f1b"] and mean["1f1b"] >= one_f_one_b_floor, idle


def test_sigterm_then_relaunch_on_the_same_and_on_another_split_continues_the_uninterrupted_run(
    launch, common_args, models, tmp_path
):
    uninterrupted = launch("qwen3-tied", "1f1b", 2)
    args = [*common_args, "-m", models["qwen3-tied"], "--max-steps", STEPS, "-b", BATCH]
    # The checkpoint names each weight as in the whole model, so a V of 2 ranks x 2 stages (rank 0 holding both
    # copies of the tied matrix) writes what 1F1B's 2 stages read.
    for run in stop_then_resume("08", [*args, "--schedule", "zbv"], 2, tmp_path, STOP_AFTER,
                                elsewhere=([*args, "--schedule", "1f1b"], 2)):
        assert_same_training(run, uninterrupted, STEPS, first_step=STOP_AFTER + 1)


@pytest.mark.parametrize("flags,message", [
    (["--num-microbatches", 3],
     "error: --num-microbatches 3 does not divide -b 8; pass a divisor of the batch size"),
    (["--stages-per-rank", 2], "error: --schedule 1f1b runs one stage per rank; use --stages-per-rank 2+ only "
                               "with --schedule dualpipev, interleaved-1f1b, interleaved-zb, zbv"),
    (["--schedule", "interleaved-1f1b", "-m", "{llama}", "--stages-per-rank", 4],
     "error: 4 layers cannot fill 8 stages (2 pipeline ranks x 4 stages per rank), each stage needs a layer; "
     "use fewer pipeline ranks or --stages-per-rank"),
    (["--schedule", "zbv", "--stages-per-rank", 3],
     "error: --schedule zbv runs two stages per rank in a V (rank r: stages r and 2P-1-r); pass "
     "--stages-per-rank 2 or leave it out"),
    (["--schedule", "dualpipev", "-m", "{llama}", "--num-microbatches", 2],
     "error: --schedule dualpipev feeds micro-batches from both ends of the 4 stages; pass --num-microbatches 4 "
     "or more (and a -b it divides)"),
    (["--schedule", "interleaved-zb", "--compile"],
     "error: --schedule interleaved-zb splits each backward in two, which torch does not do for compiled stages; "
     "drop --compile or use gpipe, 1f1b or interleaved-1f1b"),
], ids=["microbatches", "stages-per-rank", "too-few-layers", "v-of-three", "dualpipev-microbatches",
        "zero-bubble-compiled"])
def test_a_layout_that_cannot_work_fails_with_one_line_on_every_rank(common_args, models, tmp_path, flags,
                                                                     message):
    flags = [str(flag).format(**models) for flag in flags]
    run = run_chapter("08", [*common_args, "-b", BATCH, *flags], tmp_path, nproc=2, expect_ok=False, timeout=60)
    assert run.returncode != 0
    assert run.worker_stderr.count(message) == 2, run.stderr[-3000:]
    assert 'train_llm.py", line' not in run.stderr  # no traceback from the script
    assert not (run.exp_dir / "checkpoints").exists()


def test_the_v_schedules_are_refused_with_a_torch_before_2_13(models, monkeypatch):
    """torch 2.11's first step of a V schedule sends from a rank to itself, which gloo cannot (measured: "Pair is
    not connected"); 2.13 and 2.15 run them. An older torch is refused in one line, not a gloo traceback."""
    script = load_script(CHAPTERS["08"] / "train_llm.py")
    monkeypatch.setattr(script["torch"], "__version__", "2.11.0")
    config = transformers.AutoConfig.from_pretrained(models["llama"])
    for schedule in ("zbv", "dualpipev"):
        args = script["get_parser"]().parse_args(["--schedule", schedule])
        with pytest.raises(SystemExit, match=f"--schedule {schedule} needs torch 2.13 or newer \\(torch 2.11.0's"):
            script["check_pipeline_fits"](args, config, 2, 2)
    args = script["get_parser"]().parse_args(["--schedule", "interleaved-zb"])
    script["check_pipeline_fits"](args, config, 2, 2)
