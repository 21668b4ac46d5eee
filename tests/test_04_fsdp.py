"""Chapter 04 (FSDP2): trains the same model to the same numbers as chapter 01 (to the tolerances within which
DDP matches it, tests/test_02_ddp.py) while each rank holds 1/N of the weights, gradients and optimizer state;
builds a fresh model on the meta device with chapter 01's init; resumes exactly, also on another number of
ranks; exports a Hugging Face model.

The reference is chapter 01 on the whole global batch of 8 sequences for 12 steps; N ranks use -b 8/N.
"""
import json
import re
import shutil

import pytest
import torch
import transformers

from conftest import (
    CHAPTERS, INJECT, assert_same_training, inject_env, load_weights, max_weight_diff, offline_env, run_chapter,
    shard_bytes, write_tiny_model,
)
from launching import load_script

GLOBAL_BATCH = 8
STEPS = 12
STOP_AFTER = 3  # the interrupted run stops after this step
# NOTE: fp32 on CPU: N ranks sum gradients in another order than one process does, so numbers agree to
# rounding (conftest's tolerances), far below what a real bug (a wrong shard, a missing reduce-scatter, garbage
# RoPE buffers, optimizer state not restored) changes.


def on(nproc):
    return ["-b", GLOBAL_BATCH // nproc]


@pytest.fixture
def launch(launch_once, common_args):
    """A STEPS-step run of a chapter on nproc ranks (-b keeps the global batch), shared across tests. Chapter
    04 runs through tests/inject.py, which prints what each rank holds after its first step (shard_bytes)."""

    def launch_chapter(chapter, nproc=None, flags=()):
        args = [*common_args, "--max-steps", STEPS, *on(nproc or 1), *flags]
        if chapter != "04":
            return launch_once(chapter, args, nproc=nproc)
        return launch_once(chapter, args, nproc=nproc, script=INJECT, env=inject_env("04", "shard-bytes"))

    return launch_chapter


@pytest.fixture
def single_process(launch):
    return launch("01")


@pytest.fixture
def fsdp_two_ranks(launch):
    return launch("04", 2)


@pytest.mark.parametrize("nproc", [2, 4])
def test_fsdp_matches_single_process(launch, single_process, nproc):
    # the run trains (so agreeing numbers mean something): the loss falls well below its start
    assert single_process.losses[-1] < single_process.losses[0] - 0.5
    assert_same_training(launch("04", nproc), single_process)


HSDP_2X2 = ["--replicate-degree", 2]  # two copies of the model, each sharded over 2 ranks


@pytest.mark.parametrize("nproc,flags", [(2, ["--cpu-offload"]), (4, HSDP_2X2)], ids=["cpu-offload", "hsdp-2x2"])
def test_cpu_offload_and_hsdp_match_single_process(launch, single_process, nproc, flags):
    assert_same_training(launch("04", nproc, flags), single_process)


# --reshard-after-forward: false keeps each block's gathered weights from its forward to its backward (ZeRO-2's
# all-gathers); 2 of 4 ranks keeps them sharded over pairs, and the backward gathers within a pair.
KEEP_GATHERED = ["--reshard-after-forward", "false"]
RESHARD_TO_PAIRS = ["--reshard-after-forward", 2]


@pytest.mark.parametrize("nproc,flags", [(2, KEEP_GATHERED), (4, RESHARD_TO_PAIRS)], ids=["false", "2-of-4"])
def test_reshard_after_forward_false_or_to_a_smaller_group_matches_single_process(launch, single_process, nproc,
                                                                                  flags):
    assert_same_training(launch("04", nproc, flags), single_process)


def first_step_all_gathers(launch_once, common_args, nproc, flags=()):
    """[group size, bytes] of each all-gather of rank 0's first step (tests/inject.py's all-gathers probe)."""
    run = launch_once("04", [*common_args, "--max-steps", 1, *on(nproc), "--val-fraction", 0, *flags],
                      nproc=nproc, script=INJECT, env=inject_env("04", "all-gathers"))
    return json.loads(re.search(r"^rank 0: all_gathers (.*)$", run.stdout, re.MULTILINE).group(1))["1"]


def test_keeping_gathered_weights_for_backward_gathers_each_weight_once_a_step_instead_of_twice(
        launch_once, common_args, tiny_model):
    config = transformers.AutoConfig.from_pretrained(tiny_model)
    assert not config.tie_word_embeddings
    layers = config.num_hidden_layers
    kept = first_step_all_gathers(launch_once, common_args, 2, KEEP_GATHERED)
    resharded = first_step_all_gathers(launch_once, common_args, 2)
    in_pairs = first_step_all_gathers(launch_once, common_args, 4, RESHARD_TO_PAIRS)
    # The forward gathers every group once (the root's, the embedding, each block, the head) ...
    assert len(kept) == layers + 3
    # ... and with resharding the backward gathers each block and the embedding again (the head stays gathered)
    assert resharded[: layers + 3] == kept and len(resharded) == len(kept) + layers + 1
    assert sorted(resharded[layers + 3 :]) == sorted(resharded[1 : layers + 2])
    # Resharded to pairs of 4 ranks: the forward gathers over all 4, the backward within a pair only
    assert [size for size, _ in in_pairs] == [4] * (layers + 3) + [2] * (layers + 1)


def test_a_reshard_size_that_does_not_divide_the_ranks_fails_with_fsdps_reason_in_one_line(common_args, tmp_path):
    run = run_chapter("04", [*common_args, "--max-steps", 1, *on(2), "--reshard-after-forward", 3], tmp_path,
                      nproc=2, expect_ok=False)
    lines = re.findall(r"^error: .*$", run.worker_stderr, re.MULTILINE)
    assert len(lines) == 2 and lines[0] == lines[1], run.stderr[-3000:]
    assert lines[0].startswith("error: cannot reshard to 3 ranks after forward (") and lines[0].endswith(
        "); pass --reshard-after-forward true, false, or a divisor of the ranks that shard a weight"), lines[0]


def test_k_micro_batches_each_reduce_scattered_train_as_one_batch(launch, single_process):
    """2 ranks x -b 1 x 4 micro-batches: chapter 01's global batch of 8. FSDP reduce-scatters every
    micro-batch's gradients (the shards add them up), as the README measures against waiting for the last."""
    assert_same_training(launch("04", 2, ["-b", 1, "--grad-accum-steps", 4]), single_process)


@pytest.mark.parametrize("nproc,flags,shards", [(2, [], 2), (4, [], 4), (4, HSDP_2X2, 2)],
                         ids=["fsdp-2-ranks", "fsdp-4-ranks", "hsdp-2x2"])
def test_each_rank_holds_its_share_of_weights_gradients_and_optimizer_state(launch, tiny_model, nproc, flags, shards):
    by_rank = shard_bytes(launch("04", nproc, flags))
    assert sorted(by_rank) == list(range(nproc))

    tensors = load_weights(tiny_model)
    model_bytes = 4 * sum(t.numel() for t in tensors.values())  # fp32
    # NOTE: Adam keeps a step counter per parameter, a 4-byte scalar every rank holds whole.
    step_counters = 4 * len(tensors)
    for rank, held in by_rank.items():
        assert held["parameters"][1] == held["gradients"][1] == model_bytes
        assert held["optimizer_state"][1] == 2 * model_bytes + step_counters  # Adam's two moments + counters
        # NOTE: every dimension of the tiny model divides by 2 and 4, so no shard needs padding: each rank
        # holds exactly 1/shards.
        assert held["parameters"][0] * shards == model_bytes, (rank, held)
        assert held["gradients"][0] * shards == model_bytes, (rank, held)
        assert held["optimizer_state"][0] == 2 * model_bytes // shards + step_counters, (rank, held)


# Runs chapter 04's script unchanged (as __main__) and, at the first forward pass, compares the model it built
# (on the meta device, then sharded, materialised and initialised) with chapter 01's: from_config on one process.
FIRST_FORWARD_PROBE = '''
import json, os, runpy, sys
import torch, transformers

script = os.environ["TRAIN_SCRIPT"]


def inspect_first_forward(module, inputs):
    if not isinstance(module, transformers.PreTrainedModel):
        return
    handle.remove()
    reference = transformers.AutoModelForCausalLM.from_config(module.config, dtype=torch.float32)
    report = {"buffers": {}, "parameters": {}}
    for name, buffer in module.named_buffers():
        report["buffers"][name] = torch.equal(buffer, reference.get_buffer(name))
    for name, param in module.named_parameters():
        full = param.full_tensor()  # NOTE: a collective: every rank runs this hook at the same point
        half = full.shape[0] // 2
        report["parameters"][name] = {
            "std": full.std().item(), "reference_std": reference.get_parameter(name).std().item(),
            "mean": full.mean().item(), "min": full.min().item(), "max": full.max().item(),
            "row_0_max": full[0].abs().max().item(),
            "reference_row_0_max": reference.get_parameter(name)[0].abs().max().item(),
            "halves_equal": torch.equal(full[:half], full[half : 2 * half]),
        }
    if int(os.environ["RANK"]) == 0:
        with open(os.environ["PROBE_OUT"], "w") as f:
            json.dump(report, f)


handle = torch.nn.modules.module.register_module_forward_pre_hook(inspect_first_forward)
sys.argv = [script, *sys.argv[1:]]
sys.path[0] = os.path.dirname(script)
runpy.run_path(script, run_name="__main__")
'''


def test_fresh_init_matches_chapter_01s_init_and_recomputes_rope(tiny_dataset, tmp_path):
    # NOTE: hidden 256 so each matrix has 65k+ entries: a std estimate is then good to ~0.5%.
    wide = write_tiny_model(tmp_path / "wide", hidden_size=256, intermediate_size=512)
    probe = tmp_path / "probe.py"
    probe.write_text(FIRST_FORWARD_PROBE)
    env = {**offline_env(tmp_path), "TRAIN_SCRIPT": str(CHAPTERS["04"] / "train_llm.py"),
           "PROBE_OUT": str(tmp_path / "probe.json")}
    run = run_chapter("04", ["-m", wide, "-d", tiny_dataset, "-s", 32, "-b", 4, "--max-steps", 1],
                      tmp_path, nproc=2, env=env, script=probe)
    report = json.loads((tmp_path / "probe.json").read_text())

    # RoPE's inv_freq (and original_inv_freq) are in no state dict: after to_empty they hold garbage unless
    # recomputed. Equal to the bit.
    assert report["buffers"] and all(report["buffers"].values()), report["buffers"]
    for name, stats in report["parameters"].items():
        if name.endswith("norm.weight"):
            assert stats["min"] == stats["max"] == 1.0, (name, stats)
            continue
        # NOTE: HF draws every matrix from normal(0, 0.02); 5% covers the estimate's noise many times over
        # while torch's reset_parameters (embeddings std 1.0, linears uniform with std 0.036) is far outside.
        assert abs(stats["std"] / stats["reference_std"] - 1) < 0.05, (name, stats)
        assert abs(stats["mean"]) < 0.1 * stats["reference_std"], (name, stats)
        # each rank drew its own shard: the two halves are not copies of each other
        assert not stats["halves_equal"], name
    # HF zeroes the padding token's embedding row (pad id 0 here), also when the row sits in a shard
    embedding = report["parameters"]["model.embed_tokens.weight"]
    assert embedding["reference_row_0_max"] == embedding["row_0_max"] == 0
    # ... in the shard that holds it: HF's weight[0] would regather the sharded weight, which on gloo torch 2.14
    # and later does with an all-gather and a warning on every rank (.ci/torch-range.sh runs this test there)
    assert "does not support alltoall" not in run.stderr, run.stderr[-3000:]


@pytest.fixture
def interrupted(launch_once, common_args):
    """Two ranks, each sending itself SIGTERM right after optimizer step STOP_AFTER (tests/inject.py)."""
    return launch_once("04", [*common_args, "--max-steps", STEPS, *on(2)], nproc=2, expect_ok=False,
                       script=INJECT, env=inject_env("04", "sigterm", after_step=STOP_AFTER))


@pytest.mark.parametrize("nproc", [2, 4, 1])
def test_resume_from_a_two_rank_checkpoint_continues_the_uninterrupted_run(
    interrupted, fsdp_two_ranks, common_args, tmp_path, nproc
):
    """Resume on the same 2 ranks, and on 4 and on 1 with -b changed to keep the global batch of 8."""
    assert interrupted.returncode != 0
    assert interrupted.worker_stderr.count(f"stopped by a signal after step {STOP_AFTER};") == 2, interrupted.stderr[-3000:]
    assert [p.name for p in (interrupted.exp_dir / "checkpoints").iterdir()] == [f"step-{STOP_AFTER:08d}"]

    shutil.copytree(interrupted.exp_dir, tmp_path / "outputs" / "test")
    resumed = run_chapter("04", [*common_args, "--max-steps", STEPS, *on(nproc)], tmp_path, nproc=nproc)
    assert resumed.stdout.count(f"at step {STOP_AFTER}") == nproc
    assert [m["step"] for m in resumed.metrics] == list(range(1, STEPS + 1))
    if nproc == 2:
        # NOTE: same world size, same operations in the same order: bit for bit the uninterrupted run, so the
        # weights, Adam's moments and step counters, the schedule and the data position all came back.
        assert resumed.losses == fsdp_two_ranks.losses
        assert max_weight_diff(resumed.exp_dir / "hf", fsdp_two_ranks.exp_dir / "hf") == 0
    else:
        # the checkpoint was resharded on load (4 shards, or 1); sums run in another order: equal to rounding
        assert_same_training(resumed, fsdp_two_ranks)


def test_exported_model_is_chapter_01s_trained_model(fsdp_two_ranks, single_process, tiny_model):
    exported, reference = fsdp_two_ranks.exp_dir / "hf", single_process.exp_dir / "hf"
    assert load_weights(exported).keys() == load_weights(reference).keys()
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    models = [transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
              for path in (exported, reference)]
    input_ids = transformers.AutoTokenizer.from_pretrained(exported)(
        ["red green blue cat dog", "bird runs sits sings"], padding=True, return_tensors="pt"
    ).input_ids
    with torch.no_grad():
        logits = [model(input_ids).logits for model in models]
    assert (logits[0] - logits[1]).abs().max() < 1e-4
    assert max_weight_diff(exported, tiny_model) > 1e-3, "the export holds the starting weights, not the trained ones"


def test_tied_embeddings_train_tied_and_export_once(common_args, tmp_path):
    tied = write_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    runs = [run_chapter(chapter, [*common_args, "-m", tied, "--max-steps", STEPS, *on(nproc or 1)], tmp_path,
                        nproc=nproc, experiment=f"chapter-{chapter}")
            for chapter, nproc in (("01", None), ("04", 2))]
    assert_same_training(*runs)
    # one tensor for embeddings and lm_head, written once, as Hugging Face does
    assert load_weights(runs[1].exp_dir / "hf").keys() == load_weights(runs[0].exp_dir / "hf").keys()
    # The head loaded from the export IS the embedding (not a copy, not a fresh matrix) and gives ch01's logits.
    exported = transformers.AutoModelForCausalLM.from_pretrained(runs[1].exp_dir / "hf", dtype=torch.float32)
    assert exported.get_output_embeddings().weight is exported.get_input_embeddings().weight
    reference = transformers.AutoModelForCausalLM.from_pretrained(runs[0].exp_dir / "hf", dtype=torch.float32)
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        assert (exported(input_ids).logits - reference(input_ids).logits).abs().max() < 1e-4


def test_a_model_without_known_blocks_fails_with_one_line(common_args, tmp_path):
    folder = tmp_path / "gpt"
    transformers.OpenAIGPTConfig(vocab_size=272, n_positions=64, n_embd=32, n_layer=2, n_head=2).save_pretrained(folder)
    transformers.ByT5Tokenizer(extra_ids=0).save_pretrained(folder)
    # (GPT-1 has no sdpa attention: eager, so that building it succeeds and finding its blocks is what fails)
    run = run_chapter("04", [*common_args, "-m", folder, "--attn-implementation", "eager"], tmp_path, nproc=2,
                      expect_ok=False, timeout=240)

    assert run.returncode != 0
    # every rank stops with the message (a rank that went on would wait for the other in a collective until
    # run_chapter's timeout)
    assert run.worker_stderr.count("error: cannot find the transformer blocks of OpenAIGPTLMHeadModel to shard") == 2


@pytest.mark.parametrize("config_class", [
    transformers.LlamaConfig, transformers.Qwen2Config, transformers.Qwen3Config, transformers.MistralConfig,
    transformers.Gemma2Config,
])
def test_transformer_blocks_are_found_in_common_decoder_models(config_class):
    transformer_blocks = load_script(CHAPTERS["04"] / "train_llm.py")["transformer_blocks"]
    config = config_class(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                          num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    blocks = transformer_blocks(model)
    assert [type(block).__name__.endswith("DecoderLayer") for block in blocks] == [True] * 3



@pytest.mark.parametrize("chapter", ["04", "05"])
def test_cpu_offload_on_gpus_gives_the_cpu_tensors_gloo(chapter):
    """Offloaded weights and gradients are CPU tensors whose norm is all-reduced: nccl alone raises "No backend
    type associated with device type cpu" at the first step (with 2+ GPUs, so the one-GPU check cannot see it)."""
    from torch.distributed.distributed_c10d import BackendConfig

    backend = load_script(CHAPTERS[chapter] / "train_llm.py")["process_group_backend"]
    gpu = torch.device("cuda", 0)
    assert BackendConfig(backend(gpu, True)).get_device_backend_map() == {"cuda": "nccl", "cpu": "gloo"}
    assert backend(gpu, False) == "nccl"
    assert backend(torch.device("cpu"), True) == backend(torch.device("cpu"), False) == "gloo"


def test_a_damaged_sharded_checkpoint_is_set_aside_and_the_previous_one_resumes(
    fsdp_two_ranks, common_args, tmp_path
):
    """A DCP checkpoint is one file per rank plus an index: cut one rank's file short, as a full disk would."""
    args = [*common_args, "--max-steps", STEPS, *on(2), "--ckpt-freq", 2]
    stopped = run_chapter("04", args, tmp_path, nproc=2, expect_ok=False, script=INJECT,
                          env=inject_env("04", "sigterm", after_step=STOP_AFTER))
    checkpoints = stopped.exp_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000002", "step-00000003"]
    shard = sorted((checkpoints / "step-00000003").glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[:100])

    resumed = run_chapter("04", args, tmp_path, nproc=2)
    # (DCP gathers every rank's failure into one exception that every rank raises: the first rank's is named)
    assert re.search(rf"checkpoint {re.escape(str(checkpoints / 'step-00000003'))} fails to load \(\w+(: [^\n]+)?\); "
                     "set it aside", resumed.stderr)
    assert resumed.stdout.count("step-00000002 at step 2") == 2
    assert resumed.losses == fsdp_two_ranks.losses
    assert (checkpoints / "step-00000003.damaged" / shard.name).exists()
