"""Chapter 12's planner: what it says each rank holds is what the chapters' own code builds (a dry run at the
full world size on the meta device, under torch's fake process group), for every layout the chapters run, dense,
MoE and tied, at 2-8 ranks and at Llama 3.1 405B's 64; what it says a rank sends in a step is what the
chapters' collectives move (counted in real runs); a layout that cannot work is refused with the chapter's
reason; its FLOPs are the chapters' MFU count; its JSON lists every layout with what a script needs."""
import collections
import contextlib
import io
import json
import subprocess
import sys
import time

import pytest
import torch
import transformers

from conftest import CHAPTERS, INJECT, ROOT, inject_env, offline_env, probe_reports, write_tiny_model
from launching import load_script

PLANNER = ROOT / "12-choosing-a-layout" / "plan.py"
plan = load_script(PLANNER)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Four layers, so that a 2-rank V schedule has a layer for each of its 4 stages."""
    folder = tmp_path_factory.mktemp("planner-models")
    return {"llama": write_tiny_model(folder / "llama", num_hidden_layers=4),
            "tied": write_tiny_model(folder / "tied", architecture="qwen3", num_hidden_layers=4,
                                     tie_word_embeddings=True),
            "moe": write_tiny_model(folder / "moe", architecture="mixtral", num_hidden_layers=2,
                                    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)}


def planned(model, ranks, *flags, nodes=1, seq_length=64):
    """(args, config, layout, the plan) for a layout pinned by chapter flags."""
    args = plan["get_parser"]().parse_args([str(model), "--nodes", str(nodes), "--gpus-per-node", str(ranks),
                                            "-s", str(seq_length), "-b", "2", *map(str, flags)])
    config, _, layouts, plans = plan["plan_layouts"](args)
    return args, config, layouts[0], plans[0]


def dry_run(args, config, layout, planned_layout, ranks=None):
    args.dry_run_ranks = ranks
    with contextlib.redirect_stdout(io.StringIO()) as output:
        failures = plan["dry_run"](layout, config, planned_layout, args)
    return failures, output.getvalue()


# name: (model, ranks, the layout's flags); every chapter's layouts, each schedule, HSDP, a tied head, experts
LAYOUTS = {
    "02-ddp": ("llama", 2, ["--chapter", "02"]),
    "04-fsdp": ("llama", 3, ["--chapter", "04"]),
    "04-hsdp-offload": ("llama", 4, ["--replicate-degree", 2, "--cpu-offload"]),
    "04-tied": ("tied", 4, ["--chapter", "04"]),
    "05-activation-checkpointing": ("llama", 4, ["--activation-checkpointing"]),
    "06-tp4": ("llama", 4, ["--tp", 4]),
    "06-tied": ("tied", 2, ["--tp", 2]),
    "07-dp2-tp2": ("llama", 4, ["--tp", 2]),
    "07-dp4-tp2": ("llama", 8, ["--tp", 2]),
    **{f"08-{schedule}": ("llama", 2, ["--pp", 2, "--schedule", schedule, "--global-batch-size", 8])
       for schedule in ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")},
    "08-1f1b-4-ranks": ("llama", 4, ["--pp", 4]),
    "08-zbv-tied": ("tied", 2, ["--pp", 2, "--schedule", "zbv"]),
    "08-1f1b-tied": ("tied", 2, ["--pp", 2]),
    "09-pp2-dp2-tp2": ("llama", 8, ["--pp", 2, "--tp", 2]),
    "09-interleaved": ("llama", 4, ["--pp", 2, "--tp", 2, "--schedule", "interleaved-1f1b"]),
    "09-pp2-dp2-tied": ("tied", 4, ["--pp", 2, "--chapter", "09"]),
    "10-cp2": ("llama", 4, ["--cp", 2]),
    "10-cp2-hsdp": ("llama", 8, ["--cp", 2, "--replicate-degree", 2]),
    "11-ep2": ("moe", 4, ["--ep", 2]),
    "11-ep4": ("moe", 4, ["--ep", 4]),
    "11-ep2-hsdp": ("moe", 8, ["--ep", 2, "--replicate-degree", 2]),
}


@pytest.mark.parametrize("case", LAYOUTS)
def test_every_rank_holds_the_weights_gradients_and_adam_state_the_plan_counts(case, models):
    model, ranks, flags = LAYOUTS[case]
    args, config, layout, planned_layout = planned(models[model], ranks, *flags)
    assert planned_layout["reason"] is None, planned_layout["reason"]
    assert layout.chapter == case[:2]
    failures, output = dry_run(args, config, layout, planned_layout, ranks=list(range(ranks)))
    assert not failures, output
    assert output.count("equal") == 3 * ranks


@pytest.mark.parametrize("flags", [["--activation-checkpointing", "--cpu-offload", "-s", 4096],
                                   ["--tp", 8, "--pp", 8]], ids=["chapter-05-fsdp", "chapter-09-pp8-tp8"])
def test_llama_405b_on_64_ranks_builds_as_planned_within_two_minutes(flags):
    config_path = CHAPTERS["05"] / "llama-3.1-405b"
    args = plan["get_parser"]().parse_args([str(config_path), "--nodes", "8", *map(str, flags)])
    config = plan["load_config"](args.model)
    layout = plan["pinned_layout"](args)
    planned_layout = plan["plan_layout"](layout, config, plan["parameter_shapes"](config), args)
    start = time.perf_counter()
    failures, output = dry_run(args, config, layout, planned_layout)
    assert not failures, output
    assert time.perf_counter() - start < 120, output


def test_llama_8b_layouts_build_at_8_ranks_as_planned():
    config_path = PLANNER.parent / "configs" / "llama-3.1-8b"
    for flags in (["--tp", 8], ["--tp", 2], ["--pp", 8], ["--cp", 4], ["--activation-checkpointing"]):
        args, config, layout, planned_layout = planned(config_path, 8, *flags, seq_length=8192)
        failures, output = dry_run(args, config, layout, planned_layout)
        assert not failures, output


# What each collective is, by the names of torch's ops (c10d's, the functional ones) and the plan's
KINDS = {"all_reduce": ("allreduce", "all_reduce"), "all_gather": ("allgather", "_allgather", "all_gather"),
         "reduce_scatter": ("reduce_scatter", "_reduce_scatter"), "all_to_all": ("alltoall", "all_to_all"),
         "send": ("send",)}


def kind_and_bytes_sent(collective, group_size, in_bytes, out_bytes):
    """(its kind, what a rank sends) for one collective of a run, as the plan counts it: ring algorithms send
    (n-1)/n of what is gathered or scattered, twice that for a sum; a send its message. Receives, broadcasts
    and barriers (setup, the checkpoint) count nothing in either."""
    kind = next((kind for kind, names in KINDS.items() if collective.startswith(names)), None)
    share = (group_size - 1) / group_size
    sent = {"all_reduce": 2 * share * in_bytes, "all_gather": share * out_bytes,
            "reduce_scatter": share * in_bytes, "all_to_all": share * in_bytes,
            "send": in_bytes if collective == "send" else 0}
    return kind, sent.get(kind, 0)


def planned_by_kind(comm_bytes_per_step):
    """The plan's bytes a step by kind; a line of two kinds (TP's "all_gather + reduce_scatter") splits
    evenly: each forward all-gather's backward is a reduce-scatter and each reduce-scatter's an all-gather."""
    by_kind = collections.Counter()
    for collective, by_link in comm_bytes_per_step.items():
        kinds = [kind.strip() for kind in collective.split(" (")[0].replace("send/recv", "send").split("+")]
        for kind in kinds:
            by_kind[kind] += sum(by_link.values()) / len(kinds)
    return by_kind


# name: (chapter, ranks, model, the chapter's flags, the planner's flags for the same layout and batch). Each
# layout is one real run, -b 2 -s 256 in fp32, that serves both checks below; chapters 08 and 09 split -b 8 into
# 4 micro-batches of 2 rows, which the planner's -b counts (a step: 16 rows at dp 2)
PIPELINE = ["-b", 2, "--global-batch-size", 8, "--num-microbatches", 4]
PIPELINE_DP2 = ["-b", 2, "--global-batch-size", 16, "--num-microbatches", 4]
PROBED = {
    "02-ddp": ("02", 2, "llama", [], ["--chapter", "02"]),
    "04-fsdp": ("04", 2, "llama", [], ["--chapter", "04"]),
    "04-tied-gemma3": ("04", 2, "gemma3", [], ["--chapter", "04"]),
    "04-cpu-offload": ("04", 2, "llama", ["--cpu-offload"], ["--chapter", "04", "--cpu-offload"]),
    "04-hsdp": ("04", 4, "llama", ["--replicate-degree", 2], ["--chapter", "04", "--replicate-degree", 2]),
    "05-activation-checkpointing": ("05", 2, "llama", ["--activation-checkpointing"],
                                    ["--activation-checkpointing"]),
    "05-explicit-prefetch": ("05", 2, "llama", ["--explicit-prefetch"], ["--explicit-prefetch"]),
    "06-tp2": ("06", 2, "llama", [], ["--tp", 2, "--global-batch-size", 2]),
    "07-dp2-tp2": ("07", 4, "llama", ["--tp", 2], ["--tp", 2, "--global-batch-size", 4]),
    "08-1f1b": ("08", 2, "llama", ["-b", 8], ["--pp", 2, *PIPELINE]),
    "08-1f1b-tied": ("08", 2, "tied", ["-b", 8], ["--pp", 2, *PIPELINE]),
    **{f"08-{schedule}": ("08", 2, "llama", ["-b", 8, "--schedule", schedule],
                          ["--pp", 2, "--schedule", schedule, *PIPELINE])
       for schedule in ("gpipe", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")},
    "09-pp2-tp2": ("09", 4, "llama", ["-b", 8, "--pp", 2, "--tp", 2], ["--pp", 2, "--tp", 2, *PIPELINE]),
    "09-pp2-dp2": ("09", 4, "llama", ["-b", 8, "--pp", 2, "--tp", 1],
                   ["--pp", 2, "--chapter", "09", *PIPELINE_DP2]),
    "09-pp2-dp2-interleaved-tied": (
        "09", 4, "tied", ["-b", 8, "--pp", 2, "--tp", 1, "--schedule", "interleaved-1f1b"],
        ["--pp", 2, "--chapter", "09", "--schedule", "interleaved-1f1b", *PIPELINE_DP2]),
    # (the cp ranks of a dp group train the same rows)
    "10-cp2": ("10", 2, "llama", ["--cp", 2], ["--cp", 2, "--global-batch-size", 2]),
    "10-dp2-cp2": ("10", 4, "llama", ["--cp", 2], ["--cp", 2, "--global-batch-size", 4]),
    # experts routed as by a perfectly balanced router (tests/inject.py's INJECT_ROUTING); see the README for
    # what the tiny Mixtral's own router sends and holds beyond it. At ep 2 a Qwen2-MoE: a dense first layer,
    # a shared expert beside the routed ones
    "11-ep2-shared-expert": ("11", 2, "moe-shared", ["--ep", 2], ["--ep", 2]),
    "11-dp2-ep2": ("11", 4, "moe", ["--ep", 2], ["--ep", 2]),
}


@pytest.fixture(scope="module")
def big_models(tmp_path_factory):
    """Hidden 512, 4 layers (a Llama of 39 MB in fp32, a tied Qwen3 with its per-head norms, a Mixtral of 4
    experts of 64 MB, a Qwen2-MoE whose first layer is dense and whose others add a shared expert, a tied Gemma 3
    with four norms a layer): at -s 256 a step's activations outweigh the state, as in training; four layers give
    a 2-rank V schedule a layer a stage."""
    folder, sizes = tmp_path_factory.mktemp("planner-big"), dict(
        hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=512)
    return {"llama": write_tiny_model(folder / "llama", intermediate_size=1024, **sizes),
            "tied": write_tiny_model(folder / "tied", architecture="qwen3", intermediate_size=1024,
                                     tie_word_embeddings=True, **sizes),
            "moe": write_tiny_model(folder / "moe", architecture="mixtral", intermediate_size=512,
                                    num_local_experts=4, num_experts_per_tok=2, **sizes),
            "moe-shared": write_tiny_model(folder / "moe-shared", architecture="qwen2_moe", intermediate_size=1024,
                                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=512,
                                           shared_expert_intermediate_size=1024, mlp_only_layers=[0], **sizes),
            "gemma3": write_tiny_model(folder / "gemma3", architecture="gemma3", intermediate_size=1024, **sizes)}


@pytest.fixture(scope="module")
def probed(big_models, tiny_dataset, launch_once):
    """probed(case): (the run of PROBED[case] with both of tests/inject.py's probes, by rank, the plan)."""

    def probe(case):
        chapter, ranks, model, flags, planner_flags = PROBED[case]
        args = ["-m", big_models[model], "-d", tiny_dataset, "-s", 256, "--dtype", "float32", "-b", 2,
                "--max-steps", 2, *flags]
        env = inject_env(chapter, "collective-bytes,tensor-bytes")
        if chapter == "11":
            env["INJECT_ROUTING"] = "balanced"
        run = launch_once(chapter, args, nproc=ranks, env=env, script=INJECT)
        collective_bytes, tensor_bytes = probe_reports(run, "collective_bytes"), probe_reports(run, "tensor_bytes")
        assert len(collective_bytes) == len(tensor_bytes) == ranks, run.stdout[-3000:]
        reports = [{"collective_bytes": collective_bytes[rank], "tensor_bytes": tensor_bytes[rank]}
                   for rank in range(ranks)]
        *_, planned_layout = planned(big_models[model], ranks, "--dtype", "float32", *planner_flags,
                                     seq_length=256)
        return reports, planned_layout

    return probe


@pytest.mark.parametrize("case", PROBED)
def test_a_rank_sends_in_a_step_what_the_plan_counts_within_one_percent(case, probed):
    """Every collective of a real run's second step (no checkpoint in it) on its busiest rank: DDP's buckets,
    FSDP's gathers and reduce-scatters (HSDP's all-reduce across copies), tensor parallelism's DTensor
    redistributions (loss_parallel's too), the pipeline's sends, a tied matrix's gradient, the experts' token
    exchange (all-to-all, routed as a perfectly balanced router would route); each kind within 1% of the step's
    bytes, so that no kind's error hides behind another's. What the plan leaves out (the logged loss, norm
    weights' gradients under TP) stays under that. Sizes and counts are compared; the wire's bytes are the ring
    model's, on both sides."""
    reports, planned_layout = probed(case)
    sent_by_rank = []
    for report in reports:
        sent = collections.Counter()
        for collective in report["collective_bytes"]["2"]:
            kind, bytes_ = kind_and_bytes_sent(*collective)
            sent[kind] += bytes_
        sent_by_rank.append(sent)
    sent = max(sent_by_rank, key=lambda sent: sum(sent.values()))
    predicted = planned_by_kind(planned_layout["comm_bytes_per_step"])
    total = sum(predicted.values())
    for kind in set(sent) | set(predicted):
        assert sent[kind] == pytest.approx(predicted[kind], abs=0.01 * total), (kind, sent, predicted)


@pytest.mark.parametrize("case", PROBED)
def test_a_rank_holds_at_the_peak_of_a_step_what_the_plan_counts_within_five_percent(case, probed):
    """The most tensor bytes alive at once on any rank in a real run's second step (tests/inject.py's
    tensor-bytes: every storage torch's ops make, until freed) against the plan's peak: the state, the
    gathered weights and gradients and the activations, without the gradients that zero_grad freed (with
    checkpointing, at the last layer's backward with the others' gradients; in a pipeline, the micro-batches in
    flight at a backward, the stages' receive buffers and kept outputs; the zero-bubble schedules' split
    backward, which keeps a pass's weighted ops' output gradients from its input half to its weight half).
    With CPU offload, on a CPU the host's memory and the GPU's are one: the plan's GPU peak and the weights and
    AdamW state it holds on the host (the gradients come after the peak)."""
    reports, planned_layout = probed(case)
    peaks = [report["tensor_bytes"]["peak"] for report in reports]
    memory = planned_layout["memory_bytes_per_rank"]
    planned = planned_layout["peak_bytes_per_rank"] + sum(memory[part] for part in planned_layout["on_host"]
                                                          if part != "gradients")
    assert planned == pytest.approx(max(peaks), rel=0.05), (peaks, planned_layout)


# name: (model, ranks, flags, the start of the reason the chapter gives)
UNWORKABLE = {
    "heads-over-tp-3": ("llama", 3, ["--tp", 3],
                        "tensor parallelism over 3 ranks splits sizes that do not divide"),
    "experts-over-ep-3": ("moe", 3, ["--ep", 3], "--ep 3 does not divide the 4 experts of each layer"),
    "replicas-over-4-ranks": ("llama", 4, ["--replicate-degree", 3], "--replicate-degree 3 does not divide the 4"),
    "tp-with-cp": ("llama", 4, ["--tp", 2, "--cp", 2], "chapter 10's script does not take --tp; no chapter's"),
    "v-schedule-micro-batches": ("llama", 2, ["--pp", 2, "--schedule", "dualpipev", "--num-microbatches", 2],
                                 "--schedule dualpipev feeds micro-batches from both ends"),
}


@pytest.mark.parametrize("case", UNWORKABLE)
def test_a_layout_that_cannot_work_is_refused_with_the_chapters_reason_by_the_plan_and_the_dry_run(case, models):
    model, ranks, flags, reason = UNWORKABLE[case]
    args, config, layout, planned_layout = planned(models[model], ranks, *flags)
    assert planned_layout["reason"].startswith(reason) and planned_layout["refused"]
    failures, output = dry_run(args, config, layout, planned_layout)
    assert failures == [planned_layout["reason"]] and planned_layout["reason"] in output


@pytest.mark.parametrize("case", ["experts-over-ep-3", "replicas-over-4-ranks"])
def test_the_planners_own_checks_say_what_the_chapters_build_says(case, models):
    model, ranks, flags, _ = UNWORKABLE[case]
    args, config, layout, planned_layout = planned(models[model], ranks, *flags)
    with pytest.raises(SystemExit) as stop:
        plan["build_rank"](layout, config, args, 0)
    assert stop.value.code == f"error: {planned_layout['reason']}"


# flags that no chapter's script runs as given: refused with the reason, nothing planned on a wrong layout
MISPINNED = {
    "a-schedule-without-a-pipeline": (["--schedule", "zbv"], "chapter 04's script does not take --schedule; "
                                                             "chapter 08's does"),
    "more-stages-than-ranks": (["--pp", 16], "--tp 1 x --pp 16 x --cp 1 = 16 does not divide the 8 ranks"),
    "a-pipeline-in-chapter-07": (["--tp", 2, "--pp", 2, "--chapter", "07"], "chapter 07's script does not take "
                                                                            "--pp; chapter 09's does"),
    "chapter-08-on-part-of-the-ranks": (["--pp", 4, "--chapter", "08"], "chapter 08 splits over all 8 ranks"),
}


@pytest.mark.parametrize("case", MISPINNED)
def test_pinned_flags_no_chapter_runs_are_refused_not_replaced(case):
    flags, reason = MISPINNED[case]
    *_, planned_layout = planned(PLANNER.parent / "configs" / "llama-3.1-8b", 8, *flags)
    assert planned_layout["refused"] and planned_layout["reason"].startswith(reason), planned_layout["reason"]


def test_two_stages_a_rank_hold_and_send_what_one_stage_of_twice_the_layers_does():
    config_path = PLANNER.parent / "configs" / "llama-3.1-8b"
    one, two = (planned(config_path, 8, "--pp", 2, "--tp", 2, "--schedule", schedule, seq_length=4096)[3]
                for schedule in ("1f1b", "interleaved-1f1b"))
    for part in ("weights", "gathered_weights", "gathered_gradients"):
        assert one["memory_bytes_per_rank"][part] == two["memory_bytes_per_rank"][part], part
    for collective in ("all_gather (FSDP weights)", "all_gather + reduce_scatter (TP activations)"):
        assert one["comm_bytes_per_step"][collective] == two["comm_bytes_per_step"][collective], collective


def test_the_bubble_counts_every_micro_batch_of_the_accumulated_schedule():
    # chapter 08 runs --num-microbatches x the accumulation steps in one schedule call: 8 x 4 = 32
    *_, planned_layout = planned(PLANNER.parent / "configs" / "llama-3.1-8b", 8, "--pp", 8, "--schedule", "gpipe",
                                 "--num-microbatches", 8, "--global-batch-size", 64)
    assert planned_layout["bubble"] == pytest.approx(7 / (32 + 7))


@pytest.mark.parametrize("flag", ["-b", "-s", "--nodes", "--tp"])
def test_a_count_below_one_is_refused_with_one_line(flag, models, capsys):
    with pytest.raises(SystemExit) as stop:
        plan["get_parser"]().parse_args([str(models["llama"]), flag, "0"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("'0' is not a whole number of at least 1")


@pytest.mark.parametrize("model", ["llama", "tied", "moe"])
def test_flops_per_token_are_the_chapters_mfu_count(model, models):
    config = transformers.AutoConfig.from_pretrained(models[model])
    chapter = load_script(CHAPTERS["11" if model == "moe" else "04"] / "train_llm.py")
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(config)
    assert plan["flops_per_token"](config, plan["parameter_shapes"](config), 256) == \
        chapter["training_flops_per_token"](built, config, 256)


def test_json_lists_every_layout_with_its_fit_peak_step_time_and_command(models, tmp_path):
    result = subprocess.run([sys.executable, PLANNER, models["llama"], "--nodes", "1", "--gpus-per-node", "4",
                             "-s", "64", "--json"], capture_output=True, text=True, timeout=300,
                            env=offline_env(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    layouts = json.loads(result.stdout)
    chapters = {layout["layout"]["chapter"] for layout in layouts}
    assert {"02", "04", "05", "06", "07", "08", "09", "10"} <= chapters
    for layout in layouts:
        assert {"layout", "fits", "peak_bytes_per_rank", "step_time_s", "command"} <= layout.keys()
        assert {"dp", "tp", "pp", "cp", "ep"} <= layout["layout"].keys()
        assert layout["fits"] == (layout["reason"] is None)
        assert f"/train_llm.py -m {models['llama']} -s 64" in layout["command"]["torchrun"]
    fitting = [layout for layout in layouts if layout["fits"]]
    assert fitting and all(layout["step_time_s"] > 0 and layout["peak_bytes_per_rank"] > 0 for layout in fitting)
    assert [layout["step_time_s"] for layout in fitting] == sorted(layout["step_time_s"] for layout in fitting)
