"""Chapter 05 (Llama 405B): every rank reads only its own slices of the pretrained weights and gets the logits
of from_pretrained; activation checkpointing and explicit prefetch train as chapter 04 does with less activation
memory; chapter 12's planner counts exactly the bytes chapter 05's runs hold; the launch files pass only flags
the script takes; bad checkpoints fail on every rank with one line.
"""
import json
import subprocess
import sys
import time

import pytest
import torch
import transformers

from conftest import (
    INJECT, ROOT, assert_same_training, inject_env, load_weights, max_weight_diff, run_chapter, shard_bytes,
    write_tiny_model,
)
from launching import load_script

CHAPTER = ROOT / "05-training-llama-405b"
SCRIPT = CHAPTER / "train_llm.py"
PLANNER = ROOT / "12-choosing-a-layout" / "plan.py"
STEPS = 12
# A model big enough that a full copy (39 MB in fp32) stands far above one tensor (2 MB), with every size
# divisible by 2 and 4 ranks.
BIG = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
           num_key_value_heads=4, max_position_embeddings=512)
# NOTE: glibc serves big allocations from mmap and returns them on free only above this fixed threshold; its
# default threshold grows at run time, and freed activations would then stay resident and hide the next peak.
EXACT_RSS = {"MALLOC_MMAP_THRESHOLD_": "65536"}

# Runs chapter 05's script unchanged (as __main__) and measures each rank's resident memory (Linux VmHWM, reset
# through /proc/self/clear_refs): the growth while safetensors files are open (the load), and from the start of
# forward number PROBE_STEP to its optimizer step (activations). It also saves the logits of the first forward
# and the token ids that went in.
PROBE = r'''
import json, os, runpy, sys
import safetensors
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

script, out = os.environ["TRAIN_SCRIPT"], os.environ["PROBE_OUT"]
rank = int(os.environ["RANK"])
measure_step = int(os.environ["PROBE_STEP"])
report = {"load_peak": 0, "forwards": 0, "files_read": 0}


def memory():
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")}


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


real_safe_open = safetensors.safe_open


class measured_safe_open:
    def __init__(self, *args, **kwargs):
        self.inner = real_safe_open(*args, **kwargs)

    def __enter__(self):
        if "load_start" not in report:
            reset_peak()
            report["load_start"] = memory()["VmRSS"]
        report["files_read"] += 1
        return self.inner.__enter__()

    def __exit__(self, *exc):
        result = self.inner.__exit__(*exc)
        report["load_peak"] = max(report["load_peak"], memory()["VmHWM"] - report["load_start"])
        return result


safetensors.safe_open = measured_safe_open


def before_forward(module, inputs):
    if isinstance(module, torch.nn.Embedding) and report["forwards"] == 1 and "input_ids" not in report:
        report["input_ids"] = inputs[0].tolist()
    if type(module).__name__.endswith("ForCausalLM"):
        report["forwards"] += 1
        if report["forwards"] == measure_step:
            reset_peak()
            report["before_step"] = memory()["VmRSS"]


def after_forward(module, inputs, output):
    if type(module).__name__.endswith("ForCausalLM") and report["forwards"] == 1:
        torch.save(output.logits.detach().clone(), f"{out}.rank{rank}.pt")


def before_optimizer_step(optimizer, args, kwargs):
    if report["forwards"] == measure_step:
        report["activation_peak"] = memory()["VmHWM"] - report["before_step"]
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(report, f)


torch.nn.modules.module.register_module_forward_pre_hook(before_forward)
torch.nn.modules.module.register_module_forward_hook(after_forward)
register_optimizer_step_pre_hook(before_optimizer_step)
sys.argv = [script, *sys.argv[1:]]
sys.path[0] = os.path.dirname(script)
runpy.run_path(script, run_name="__main__")
'''


# NOTE: in this process: a python start with transformers costs 5-10 s on a busy 2-core machine.
planner = load_script(PLANNER)


def plan(*args):
    """The planner's plan of the chapter 05 layout these command-line arguments pin, in bytes."""
    *_, plans = planner["plan_layouts"](planner["get_parser"]().parse_args(["--chapter", "05", *map(str, args)]))
    return plans[0]


@pytest.fixture(scope="module")
def big_models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("big")
    untied = write_tiny_model(folder / "untied", **BIG)
    # Llama 3.1 ships bf16 weights: the load converts them to the fp32 master weights.
    transformers.AutoModelForCausalLM.from_pretrained(untied, dtype=torch.bfloat16).save_pretrained(untied)
    tied = write_tiny_model(folder / "tied", seed=1, tie_word_embeddings=True, **BIG)
    return {"untied": untied, "tied": tied}


# (model, ranks, -s, flags): each launch checks the load (logits, memory) and measures activations.
PROBED = [("untied", 2, 256, []), ("untied", 4, 128, []), ("tied", 2, 256, ["--activation-checkpointing"]),
          ("tied", 4, 128, ["--activation-checkpointing"])]
PROBED_IDS = [f"{model}-{nproc}-ranks" for model, nproc, _, _ in PROBED]


@pytest.fixture(scope="module")
def probed(big_models, tiny_dataset, tmp_path_factory):
    """{(model, ranks, -s, flags): per-rank reports} of two steps from the pretrained big models."""
    probe = tmp_path_factory.mktemp("probe") / "probe.py"
    probe.write_text(PROBE)
    reports = {}
    for model, nproc, seq_length, flags in PROBED:
        tmp_path = tmp_path_factory.mktemp(f"{model}-{nproc}")
        env = {**EXACT_RSS, "TRAIN_SCRIPT": str(SCRIPT), "PROBE_OUT": str(tmp_path / "probe"),
               "PROBE_STEP": "2"}
        run_chapter("05", ["-m", big_models[model], "--from-pretrained", "-d", tiny_dataset, "-s", seq_length,
                           "-b", 2, "--dtype", "float32", "--max-steps", 2, "--warmup-steps", 1, *flags],
                    tmp_path, nproc=nproc, env=env, script=probe)
        reports[model, nproc, seq_length, tuple(flags)] = [
            {**json.loads((tmp_path / f"probe.rank{rank}.json").read_text()),
             "logits": torch.load(tmp_path / f"probe.rank{rank}.pt")} for rank in range(nproc)
        ]
    return reports


@pytest.mark.parametrize("model,nproc,seq_length,flags", PROBED, ids=PROBED_IDS)
def test_sharded_load_gives_from_pretrained_logits_on_every_rank(
    probed, big_models, model, nproc, seq_length, flags
):
    reference = transformers.AutoModelForCausalLM.from_pretrained(big_models[model], dtype=torch.float32).eval()
    tied = reference.get_output_embeddings().weight is reference.get_input_embeddings().weight
    assert tied == (model == "tied")
    for report in probed[model, nproc, seq_length, tuple(flags)]:
        with torch.no_grad():
            expected = reference(torch.tensor(report["input_ids"]), use_cache=False).logits
        # NOTE: fp32; the sharded model sums in the same order on CPU, so only rounding differs (measured 0).
        assert (report["logits"] - expected).abs().max() < 1e-4


@pytest.mark.parametrize("model,nproc,seq_length,flags", PROBED, ids=PROBED_IDS)
def test_loading_adds_at_most_one_tensor_to_any_rank(probed, big_models, model, nproc, seq_length, flags):
    weights = load_weights(big_models[model])
    model_bytes = 4 * sum(t.numel() for t in weights.values())  # as fp32 master weights
    largest_tensor = 4 * max(t.numel() for t in weights.values())
    files = len(list(big_models[model].glob("*.safetensors")))
    for rank, report in enumerate(probed[model, nproc, seq_length, tuple(flags)]):
        # NOTE: every rank opened the checkpoint's files itself, so the peak below is the load's, not zero.
        assert report["files_read"] >= files >= 1, (rank, report)
        # The rank's shard was allocated before the load; reading fills it in place, one tensor's rows at a
        # time. Rank 0 loading the whole model, as chapter 04 does, would add model_bytes (39 MB) here.
        # NOTE: 1 MB for page tables and allocator slack, measured under 0.7 MB.
        assert report["load_peak"] < largest_tensor + 2**20 < model_bytes / 8, (rank, report["load_peak"])


@pytest.mark.parametrize("model,nproc,seq_length,flags", PROBED, ids=PROBED_IDS)
def test_planner_step_estimate_is_within_20_percent_of_measured(
    probed, big_models, model, nproc, seq_length, flags
):
    """What a step adds to a rank's memory at its peak: the planner's activations plus the gathered weights and
    gradients of the blocks in flight (the gradient shards were freed by zero_grad(set_to_none=True); with
    checkpointing, the peak comes at the last layer's backward, with the other layers' gradient shards)."""
    planned_layout = plan(big_models[model], "--nodes", 1, "--gpus-per-node", nproc, "-b", 2, "-s", seq_length,
                          "--dtype", "float32", *flags)
    estimate = planned_layout["memory_bytes_per_rank"]
    # the peak less the state a step starts with (the gradients, when kept, are the step's too)
    planned = planned_layout["peak_bytes_per_rank"] - estimate["weights"] - estimate["optimizer"]
    for rank, report in enumerate(probed[model, nproc, seq_length, tuple(flags)]):
        measured = report["activation_peak"]
        print(f"{model} -s {seq_length} {flags} rank {rank}: a step adds {measured / 1e6:.1f} MB, planned "
              f"{planned / 1e6:.1f} MB, of which activations {estimate['activations'] / 1e6:.1f} MB")
        assert abs(planned / measured - 1) < 0.2, (rank, measured, estimate)


def test_activation_checkpointing_lowers_the_peak_of_a_step(probed):
    """At -s 256 (2 ranks) and -s 128 (4 ranks), with checkpointing against without; tying the head changes
    no activation. The gathered weights and gradients (31 MB) are the same in both."""
    for seq_length, nproc in ((256, 2), (128, 4)):
        full = probed["untied", nproc, seq_length, ()][0]["activation_peak"]
        checkpointed = probed["tied", nproc, seq_length, ("--activation-checkpointing",)][0]["activation_peak"]
        # NOTE: measured 102 -> 66 MB at -s 256, 68 -> 49 MB at -s 128
        assert checkpointed < 0.8 * full, (seq_length, checkpointed, full)


@pytest.fixture(scope="module")
def parity_args(tiny_model, tiny_dataset):
    """chapter 04's test flags (tests/test_04_fsdp.py) on 2 ranks, so this launch of chapter 04 is shared."""
    return ["-m", tiny_model, "--from-pretrained", "-d", tiny_dataset, "-s", 32, "--dtype", "float32",
            "--log-freq", 1, "--warmup-steps", 2, "--max-steps", STEPS, "-b", 4]


@pytest.fixture(scope="module")
def chapter_04(launch_once, parity_args):
    return launch_once("04", parity_args, nproc=2, script=INJECT, env=inject_env("04", "shard-bytes"))


@pytest.fixture(scope="module")
def chapter_05(launch_once, parity_args):
    """chapter 05 on 2 ranks; tests/inject.py prints what each rank holds after step 1."""
    env = {**inject_env("04", "shard-bytes"), "INJECT_SCRIPT": str(SCRIPT)}
    return launch_once("05", parity_args, nproc=2, script=INJECT, env=env)


@pytest.mark.parametrize("flags", [[], ["--activation-checkpointing", "--explicit-prefetch"]],
                         ids=["plain", "checkpointing-and-prefetch"])
def test_loss_matches_chapter_04_step_by_step(launch_once, chapter_04, chapter_05, parity_args, flags):
    run = launch_once("05", [*parity_args, *flags], nproc=2, script=SCRIPT) if flags else chapter_05
    assert chapter_04.losses[-1] < chapter_04.losses[0] - 0.5  # it trains, so agreement means something
    assert_same_training(run, chapter_04, STEPS)


def test_planner_counts_the_weight_gradient_and_adam_bytes_each_rank_holds(chapter_05, tiny_model):
    held = shard_bytes(chapter_05)
    estimate = plan(tiny_model, "--nodes", 1, "--gpus-per-node", 2, "--dtype", "float32", "-s", 32)
    assert estimate["fits"] and sorted(held) == [0, 1]
    # the planner reports the fullest rank (rank 0: fully_shard gives it ceil(rows / ranks) of every weight)
    for part, key in (("weights", "parameters"), ("gradients", "gradients"), ("optimizer", "optimizer_state")):
        assert estimate["memory_bytes_per_rank"][part] == max(held[rank][key][0] for rank in held), key


def test_planner_counts_the_host_copy_an_async_checkpoint_stages(chapter_05, tiny_model):
    held = shard_bytes(chapter_05)
    estimate = plan(tiny_model, "--nodes", 1, "--gpus-per-node", 2, "--dtype", "float32", "-s", 32,
                    "--async-checkpoint")
    # what a checkpoint holds of each rank (its weights and Adam state, not its gradients), staged by both ranks
    staged = sum(held[rank][key][0] for rank in held for key in ("parameters", "optimizer_state"))
    fullest = max(held[rank]["parameters"][0] + held[rank]["optimizer_state"][0] for rank in held)
    assert estimate["on_host"] == ["checkpoint_staging"]
    assert estimate["memory_bytes_per_rank"]["checkpoint_staging"] == fullest
    assert estimate["host_bytes_per_node"] == 2 * fullest >= staged


def launch_file_args(model_dir, dataset):
    """The train_llm.py flags that llama_405b_args.sh gives both launchers, as bash expands them."""
    shown = subprocess.run(
        ["bash", "-c", f'source {CHAPTER / "llama_405b_args.sh"} && printf "%s\\n" "${{train_args[@]}}"'],
        capture_output=True, text=True, check=True, env={"MODEL_DIR": str(model_dir), "DATASET": str(dataset)},
    )
    return shown.stdout.splitlines()


def test_every_flag_the_launch_files_pass_parses(tiny_model, tiny_dataset):
    for launcher in ("job.sbatch", "ssh_launch.sh"):
        text = (CHAPTER / launcher).read_text()
        assert 'source "$' in text and "llama_405b_args.sh" in text and '"${train_args[@]}"' in text, launcher
    assert "TRAIN_SCRIPT=" in (CHAPTER / "job.sbatch").read_text()
    assert "#SBATCH --nodes=8" in (CHAPTER / "job.sbatch").read_text()
    args = launch_file_args(tiny_model, tiny_dataset)
    # argparse exits (and the test fails) on any flag it does not know, or a value it rejects
    parsed = load_script(SCRIPT)["get_parser"]().parse_args(args)
    assert parsed.from_pretrained and parsed.cpu_offload and parsed.activation_checkpointing
    assert parsed.async_checkpoint
    # the layout the launch files run is the one the planner says fits, in GPU and in CPU memory
    estimate = plan("--nodes", 8, "--gpus-per-node", 8, "-b", parsed.batch_size, "-s", parsed.seq_length,
                    "--cpu-offload", "--activation-checkpointing", "--explicit-prefetch", "--async-checkpoint")
    assert estimate["fits"] and estimate["largest_batch_size"] >= parsed.batch_size, estimate
    assert estimate["memory_bytes_per_rank"]["checkpoint_staging"] > 0


@pytest.mark.parametrize("flags,line", [
    (["--replicate-degree", 3], "error: chapter 05: dp 64, HSDP x3: --replicate-degree 3 does not divide the 64"),
    ([], "error: chapter 05: dp 64: does not fit: "),
    (["-s", 4096, "--cpu-offload", "--activation-checkpointing", "--async-checkpoint", "--host-memory-gb", 1024],
     "error: chapter 05: dp 64, activation checkpointing, CPU offload, async checkpoint: does not fit: the "
     "offloaded states and the checkpoint's staging copy need 1420 GB of CPU memory a node, which has 1024 GB"),
], ids=["replicas-do-not-divide", "does-not-fit-the-gpu", "does-not-fit-the-host"])
def test_planner_reports_a_bad_layout_with_one_line(flags, line, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(PLANNER), "--chapter", "05", *map(str, flags)])
    with pytest.raises(SystemExit) as exit:
        planner["main"]()
    assert exit.value.code == 1
    printed = capsys.readouterr().out.splitlines()
    assert [text for text in printed if text.startswith("error:")] == [
        next(text for text in printed if text.startswith(line))
    ], printed


@pytest.mark.parametrize("half", [(), ("model.embed_tokens.weight", "lm_head.weight")], ids=["fp32", "mixed"])
def test_planner_reads_what_the_checkpoint_stores(half, tiny_model, tmp_path, capsys, monkeypatch):
    """The per-rank read follows the dtypes of the safetensors files, not an assumed bf16: an fp32 checkpoint,
    and one that stores the embedding and head in bf16 and the rest in fp32."""
    from safetensors.torch import save_file

    weights = {name: tensor.to(torch.bfloat16) if name in half else tensor
               for name, tensor in load_weights(tiny_model).items()}
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_bytes((tiny_model / "config.json").read_bytes())
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    stored = sum(t.numel() * t.element_size() for t in weights.values())
    fp32_model = 4 * sum(t.numel() for t in weights.values())
    estimate = plan(folder, "--nodes", 1, "--gpus-per-node", 2)["pretrained_load"]
    # every dim 0 of the tiny model is even: each of 2 ranks reads exactly half of the stored bytes
    assert estimate["bytes_per_rank"] == stored // 2 and stored % 2 == 0
    assert estimate["dtypes"] == (["bfloat16", "float32"] if half else ["float32"])
    monkeypatch.setattr(sys, "argv", [str(PLANNER), str(folder), "--nodes", "1", "--gpus-per-node", "2",
                                      "--chapter", "05"])
    planner["main"]()
    printed = capsys.readouterr().out.splitlines()
    line = next(" ".join(text.split()) for text in printed if "--from-pretrained" in text)
    # a few hundred kB: printed in MB with two decimals, where a GB figure would round to 0 or 1
    assert f"{stored / 2 / 1e6:.2f} MB read by each rank (its rows, in {' + '.join(estimate['dtypes'])} per " \
           f"the safetensors headers; chapter 04's load holds {fp32_model / 1e6:.2f} MB on rank 0)" in line, line


def checkpoint_without_safetensors(folder):
    write_tiny_model(folder)
    (folder / "model.safetensors").unlink()
    return folder, (f"error: --from-pretrained reads safetensors files from a local folder, and {str(folder)!r} is "
                    "not one that holds them")


def checkpoint_of_another_shape(folder):
    write_tiny_model(folder)
    write_tiny_model(folder.parent / "wider", intermediate_size=256)
    (folder / "model.safetensors").write_bytes((folder.parent / "wider" / "model.safetensors").read_bytes())
    return folder, "error: model.layers.0.mlp.gate_proj.weight is [256, 64] in"


@pytest.mark.parametrize("make", [checkpoint_without_safetensors, checkpoint_of_another_shape],
                         ids=["no-safetensors", "shapes-differ"])
def test_a_bad_checkpoint_fails_on_every_rank_with_one_line(make, tiny_dataset, tmp_path):
    folder, line = make(tmp_path / "model")
    started = time.monotonic()
    run = run_chapter("05", ["-m", folder, "--from-pretrained", "-d", tiny_dataset, "-s", 32, "-b", 4],
                      tmp_path, nproc=2, expect_ok=False, script=SCRIPT)
    assert run.returncode != 0
    assert [text for text in run.worker_stderr.splitlines() if text.startswith("error:")] == [
        next(text for text in run.worker_stderr.splitlines() if text.startswith(line))
    ] * 2, run.stderr[-3000:]
    # NOTE: a torchrun of two ranks takes about 10 s to start on a busy 2-core machine; a rank waiting for
    # another in a collective would take the process-group timeout (60 minutes) instead.
    assert time.monotonic() - started < 60
    assert not (run.exp_dir / "checkpoints").exists() and not (run.exp_dir / "hf").exists()


# --async-checkpoint: writes at steps 4 and 8 go on while the next steps train; the one at 12 is waited for.
ASYNC = ["--ckpt-freq", 4, "--async-checkpoint"]


@pytest.fixture(scope="module")
def written_in_the_background(launch_once, parity_args):
    return launch_once("05", [*parity_args, *ASYNC], nproc=2, script=SCRIPT)


def checkpoint_state(checkpoint_dir):
    """A DCP checkpoint's model and optimizer tensors by name, each whole (every rank's shards joined)."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(checkpoint_dir, f"{tmp}/whole.pt")
        whole = torch.load(f"{tmp}/whole.pt", weights_only=False)
    tensors = {f"model/{name}": value for name, value in whole["model"].items()}
    for param, state in whole["optimizer"]["state"].items():
        tensors.update({f"optimizer/{param}/{key}": value for key, value in state.items()})
    return tensors


def assert_same_checkpoints(ours, reference, names):
    """Two runs keep the checkpoints `names`, their weights and Adam state equal bit for bit."""
    for name in names:
        mine, theirs = (checkpoint_state(run.exp_dir / "checkpoints" / name) for run in (ours, reference))
        assert mine.keys() == theirs.keys() and any(key.startswith("optimizer/") for key in mine)
        assert all(mine[key].equal(theirs[key]) for key in mine), name


def test_async_checkpoints_train_and_save_bit_for_bit_what_synchronous_ones_do(
    launch_once, parity_args, written_in_the_background
):
    synchronous = launch_once("05", [*parity_args, "--ckpt-freq", 4], nproc=2, script=SCRIPT)
    assert written_in_the_background.losses == synchronous.losses
    assert max_weight_diff(written_in_the_background.exp_dir / "hf", synchronous.exp_dir / "hf") == 0
    # step 8's state was copied before steps 9-11 changed the weights: its write saw none of them
    kept = ["step-00000008", "step-00000012"]
    assert sorted(path.name for path in (written_in_the_background.exp_dir / "checkpoints").iterdir()) == kept
    assert_same_checkpoints(written_in_the_background, synchronous, kept)


def test_sigterm_while_a_write_is_in_flight_completes_it_then_stops_and_a_relaunch_continues(
    parity_args, written_in_the_background, tmp_path
):
    args = [*parity_args, *ASYNC]
    stopped = run_chapter("05", args, tmp_path, nproc=2, script=INJECT, expect_ok=False,
                          env=inject_env("05", "sigterm-in-write", after_step=2))
    assert "inject: sigterm-in-write on rank 1 in background write 2 after step 8" in stopped.stderr
    assert stopped.worker_stderr.count("stopped by a signal after step 9;") == 2, stopped.stderr[-3000:]
    # the write of step 8 was finished and completed, then step 9 was saved
    assert sorted(path.name for path in (stopped.exp_dir / "checkpoints").iterdir()) == [
        "step-00000008", "step-00000009"]
    resumed = run_chapter("05", args, tmp_path, nproc=2, script=SCRIPT)
    assert resumed.stdout.count("at step 9") == 2
    assert resumed.losses == written_in_the_background.losses
    assert_same_checkpoints(resumed, written_in_the_background, ["step-00000012"])


def test_sigkill_while_a_write_is_in_flight_resumes_from_the_previous_complete_checkpoint(
    parity_args, written_in_the_background, tmp_path
):
    args = [*parity_args, *ASYNC]
    killed = run_chapter("05", args, tmp_path, nproc=2, script=INJECT, expect_ok=False,
                         env=inject_env("05", "sigkill-in-write", rank=1, after_step=2))
    assert killed.returncode != 0
    assert "inject: sigkill-in-write on rank 1 in background write 2 after step 8" in killed.stderr
    # rank 0 wrote its part of step 8 and rank 1 died writing its own: step 8 is not complete
    assert sorted(path.name for path in (killed.exp_dir / "checkpoints").iterdir()) == [
        "step-00000004", "step-00000008.partial"]
    resumed = run_chapter("05", args, tmp_path, nproc=2, script=SCRIPT)
    assert resumed.stdout.count("at step 4") == 2
    assert resumed.losses == written_in_the_background.losses
    assert_same_checkpoints(resumed, written_in_the_background, ["step-00000012"])
