"""Chapter 10 (context parallelism + FSDP2): with every sequence cut over --cp ranks it trains the same model
to the same numbers as chapter 01 on whole sequences (fp32, CPU, gloo), for a Llama and for a Qwen3 with
per-head q/k norms and grouped-query attention; a checkpoint resumes on other cp sizes; the export is the
ordinary model; a layout or a model that the attention cannot split fails with one line.

The reference is chapter 01 at -b 8 for 12 steps at -s 32: 4 chunks of 8 tokens at --cp 2, 8 of 4 at --cp 4.
"""
import json
import shutil

import pytest
import torch
import transformers

from conftest import (
    CHAPTERS, INJECT, assert_same_training, inject_env, model_launcher, run_chapter, write_tiny_model,
)
from launching import load_script

STEPS = 12
STOP_AFTER = 4
# (processes, flags): (dp, cp) = (1, 2), (2, 2), (1, 4), each at chapter 01's global batch of 8 sequences.
LAYOUTS = {
    "dp1-cp2": (2, ["--cp", 2, "-b", 8]),
    "dp2-cp2": (4, ["--cp", 2, "-b", 4]),
    "dp1-cp4": (4, ["--cp", 4, "-b", 8]),
}
MISTRAL = transformers.MistralConfig(vocab_size=272, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     sliding_window=16)


@pytest.fixture(scope="module")
def models(tiny_model, tmp_path_factory):
    """The tests' tiny Llama (4 heads, 4 key/value heads), and a Qwen3 whose 4 query heads share 2 key/value
    heads and whose queries and keys are normalised per head before RoPE."""
    qwen3 = write_tiny_model(tmp_path_factory.mktemp("qwen3-gqa"), architecture="qwen3",
                             num_key_value_heads=2)
    return {"llama": tiny_model, "qwen3-gqa": qwen3}


@pytest.fixture
def launch(launch_once, common_args, models):
    """A STEPS-step run of a chapter with one of the models, shared across tests (chapter 01's Llama run is
    also tests/test_04_fsdp.py's reference)."""
    return model_launcher(launch_once, common_args, models, STEPS, "llama")


# The Qwen3's difference (grouped-query heads, per-head norms) meets the sequence split, which dp does not change:
# it runs at cp 2 and cp 4 on one dp rank.
RUNS = [("llama", layout) for layout in LAYOUTS] + [("qwen3-gqa", "dp1-cp2"), ("qwen3-gqa", "dp1-cp4")]


@pytest.mark.parametrize("model,layout", RUNS, ids=[f"{model}-{layout}" for model, layout in RUNS])
def test_context_parallel_matches_single_process(launch, model, layout):
    reference = launch("01", model)
    # the run trains (so agreeing numbers mean something): the loss falls well below its start
    assert reference.losses[-1] < reference.losses[0] - 0.5
    nproc, flags = LAYOUTS[layout]
    assert_same_training(launch("10", model, nproc, flags), reference)


def test_hsdp_under_context_parallelism_matches_single_process(launch):
    """4 ranks as (dp, cp) = (2, 2), HSDP (2 replicas of the model, each sharded over 2 ranks) beside cp 2.
    Accumulation under cp (--global-batch-size sets K from the dp ranks, not all ranks) is
    tests/test_masked_labels.py's chapter 10 layout."""
    assert_same_training(launch("10", "llama", 4, ["--cp", 2, "-b", 4, "--replicate-degree", 2]), launch("01"))


@pytest.mark.parametrize("nproc,flags", [(1, ["--cp", 1, "-b", 8]), (4, ["--cp", 4, "-b", 8])],
                         ids=["cp1", "cp4"])
def test_a_cp2_checkpoint_resumes_on_other_cp_sizes(launch, common_args, tmp_path, nproc, flags):
    """Stopped after step STOP_AFTER at (dp, cp) = (1, 2), resumed at cp 1 (one rank) and at cp 4: the losses
    go on as the uninterrupted cp 2 run's, to rounding (DCP reshards the checkpoint)."""
    layout = LAYOUTS["dp1-cp2"]
    stopped = launch("10", "llama", *layout, expect_ok=False, script=INJECT,
                     env=inject_env("10", "sigterm", after_step=STOP_AFTER))
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    assert [p.name for p in (stopped.exp_dir / "checkpoints").iterdir()] == [f"step-{STOP_AFTER:08d}"]
    shutil.copytree(stopped.exp_dir, tmp_path / "outputs" / "test")
    resumed = run_chapter("10", [*common_args, "--max-steps", STEPS, *flags], tmp_path, nproc=nproc)
    assert f"at step {STOP_AFTER}" in resumed.stdout
    assert_same_training(resumed, launch("10", "llama", *layout))


def test_the_export_is_the_ordinary_model(launch):
    """The export names no attention of ours: from_pretrained builds it with the usual one, in a process that
    never registered context_parallel_attention, and it computes what chapter 01's trained model computes."""
    exported = launch("10", "llama", *LAYOUTS["dp1-cp2"]).exp_dir / "hf"
    reference = launch("01").exp_dir / "hf"
    assert "context_parallel" not in (exported / "config.json").read_text()
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    models = [transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
              for path in (exported, reference)]
    assert models[0].config._attn_implementation == "sdpa"
    input_ids = torch.randint(3, 200, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (models[0](input_ids).logits - models[1](input_ids).logits).abs().max() < 1e-4


def test_ranks_that_cp_does_not_divide_fail_with_one_line_on_every_rank(common_args, tmp_path):
    run = run_chapter("10", [*common_args, "--cp", 3], tmp_path, nproc=4, expect_ok=False, timeout=60)
    message = ("error: --cp 3 does not divide the 4 ranks; pass a divisor of the number of ranks (a cp group "
               "is best kept inside one node)")
    assert run.returncode != 0
    assert run.worker_stderr.count(message) == 4, run.stderr[-3000:]
    assert 'train_llm.py", line' not in run.stderr  # no traceback from the script
    assert not (run.exp_dir / "checkpoints").exists()


@pytest.mark.parametrize("flags,config,message", [
    (["--cp", 2, "-s", 30], None,
     "-s 30 does not cut into 2 x --cp = 4 chunks of equal length; pass a multiple of 4"),
    (["--cp", 1, "-s", 31], None,
     "-s 31 does not cut into 2 x --cp = 2 chunks of equal length; pass a multiple of 2"),
    (["--cp", 2, "--attn-implementation", "eager"], None,
     "--cp brings its own attention (this rank's queries against the gathered keys and values); leave out "
     "--attn-implementation"),
    (["--cp", 2, "-s", 32], MISTRAL,
     "mistral attends within a sliding window of 16 tokens, which this chapter's attention does not implement; "
     "pass -s 16 or less, or use chapter 04"),
    (["--cp", 2], transformers.Gemma2Config(),
     "gemma2 caps its attention logits, which this chapter's attention does not implement; train this model "
     "with chapter 04"),
    (["--cp", 2], transformers.LlamaConfig(num_hidden_layers=2,
                                           layer_types=["full_attention", "linear_attention"]),
     "llama has linear_attention layers, which this chapter does not split over ranks; train this model with "
     "chapter 04"),
    (["--cp", 2], transformers.LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
     "llama's dynamic RoPE scales by the longest position a rank sees, which differs between cp ranks; train "
     "this model with chapter 04"),
], ids=["sequence", "odd-sequence", "attention", "sliding-window", "soft-capping", "hybrid-layers",
        "dynamic-rope"])
def test_what_this_attention_cannot_split_is_refused_with_one_line(flags, config, message):
    """The check every rank runs before it builds the model (the launched test above shows that such a line
    reaches every rank and stops the job)."""
    script = load_script(CHAPTERS["10"] / "train_llm.py")
    args = script["get_parser"]().parse_args(list(map(str, flags)))
    with pytest.raises(SystemExit) as stopped:
        script["check_context_parallel_fits"](args, config or transformers.LlamaConfig(), 2)
    assert str(stopped.value) == f"error: {message}"


def test_a_window_longer_than_the_sequence_and_a_window_never_used_pass_the_check():
    script = load_script(CHAPTERS["10"] / "train_llm.py")
    for flags, config in [(["--cp", 2, "-s", 16], MISTRAL), (["--cp", 1, "-s", 16], MISTRAL),
                          (["--cp", 2, "-s", 4096], transformers.Qwen3Config(sliding_window=16))]:
        args = script["get_parser"]().parse_args(list(map(str, flags)))
        script["check_context_parallel_fits"](args, config, 2)


def test_the_attention_in_query_blocks_equals_causal_attention_and_its_gradients():
    """A sequence of 3000 tokens at cp 1 goes through the CPU path in blocks of 1024, 476, 1024 and 476 queries
    (two chunks of 1500), with 4 query heads over 2 key/value heads: the output and the gradients of the
    queries, keys and values equal one causal SDPA over the whole sequence."""
    import torch.distributed as dist
    import torch.nn.functional as F

    script = load_script(CHAPTERS["10"] / "train_llm.py")
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, heads, 3000, 16, generator=generator, requires_grad=True)
                         for heads in (4, 2, 2))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ours, _ = script["context_parallel_attention"](dist.group.WORLD, None, query, key, value, None,
                                                       scaling=0.3)
        ours.sum().backward()
    finally:
        dist.destroy_process_group()
    our_grads = [tensor.grad for tensor in (query, key, value)]
    for tensor in (query, key, value):
        tensor.grad = None
    expected = F.scaled_dot_product_attention(query, key.repeat_interleave(2, dim=1),
                                              value.repeat_interleave(2, dim=1), is_causal=True, scale=0.3)
    expected = expected.transpose(1, 2)
    expected.sum().backward()
    assert (ours - expected).abs().max() < 1e-5
    for mine, theirs in zip(our_grads, (query.grad, key.grad, value.grad)):
        assert (mine - theirs).abs().max() < 1e-4
