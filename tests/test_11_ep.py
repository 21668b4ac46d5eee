"""Chapter 11 (expert parallelism + FSDP2): with every MoE layer's experts split over --ep ranks and the tokens
sent to them, it trains the same model to the same numbers as chapter 01 running the whole MoE in one process
(fp32, CPU, gloo), for a Mixtral and a Qwen3-MoE (4 experts, top-2), at (dp, ep) = (1, 2), (2, 2), (1, 4); with
the load-balancing loss on, ep 2 and 4 train as ep 1 does; a rank computes with 1/ep of the experts; a
checkpoint resumes on other ep sizes; the export is the ordinary model; bad layouts fail with one line.

The reference is chapter 01 at -b 8 for 10 steps at -s 32 (the global batch of 8 sequences everywhere).
"""
import json
import shutil

import pytest
import torch
import transformers
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from conftest import (
    CHAPTERS, INJECT, MOE_SIZES, assert_same_training, inject_env, model_launcher, run_chapter, with_model,
    write_tiny_model,
)
from launching import load_script

STEPS = 10
STOP_AFTER = 4
# (processes, flags): (dp, ep) = (1, 2), (2, 2), (1, 4), each at chapter 01's global batch of 8 sequences.
LAYOUTS = {
    "dp1-ep2": (2, ["--ep", 2, "-b", 4]),
    "dp2-ep2": (4, ["--ep", 2, "-b", 2]),
    "dp1-ep4": (4, ["--ep", 4, "-b", 2]),
}
NO_AUX_LOSS = ["--aux-loss-coef", 0]
AUX_LOSS_ON = ["-b", 2, "--aux-loss-coef", 0.1]  # on 4 ranks


@pytest.fixture(scope="module")
def models(tiny_moe, tmp_path_factory):
    """Two tiny MoEs of 4 experts, each token taking 2: a Mixtral and a Qwen3-MoE (q/k norms, grouped-query
    attention, experts of their own width, top-k weights renormalised)."""
    return {
        "mixtral": tiny_moe,
        "qwen3-moe": write_tiny_model(tmp_path_factory.mktemp("qwen3-moe"), architecture="qwen3_moe",
                                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                      norm_topk_prob=True, **MOE_SIZES),
    }


@pytest.fixture
def launch(launch_once, common_args, models):
    """A STEPS-step run of a chapter with one of the MoEs, shared across tests."""
    return model_launcher(launch_once, common_args, models, STEPS, "mixtral")


# The Qwen3-MoE's difference (experts of their own width, renormalised top-k weights, q/k norms) meets the expert
# split, which dp does not change: it runs at ep 2 and ep 4 on one dp rank.
RUNS = [("mixtral", layout) for layout in LAYOUTS] + [("qwen3-moe", "dp1-ep2"), ("qwen3-moe", "dp1-ep4")]


@pytest.mark.parametrize("model,layout", RUNS, ids=[f"{model}-{layout}" for model, layout in RUNS])
def test_expert_parallel_matches_single_process(launch, model, layout):
    reference = launch("01", model)
    # the run trains (so agreeing numbers mean something): the loss falls well below its start
    assert reference.losses[-1] < reference.losses[0] - 0.5
    nproc, flags = LAYOUTS[layout]
    run = launch("11", model, nproc, [*flags, *NO_AUX_LOSS])
    assert_same_training(run, reference)
    # every (token, chosen expert) pair of the global batch is counted once: 8 rows x 32 tokens x top-2 x 2 layers
    for metrics in run.metrics:
        assert sum(metrics["tokens_per_expert"]) == 8 * 32 * 2 * 2
        assert metrics["max_expert_load"] >= 1.0


# Three more MoE layouts, each against chapter 01 at (dp, ep) = (1, 2): GPT-OSS (transposed experts with biases,
# a clamped gate, a router with a bias, attention sinks and sliding layers), Qwen2-MoE (a shared expert beside
# the routed ones) and DeepSeek-V3 (multi-head latent attention, grouped routing, a dense first layer).
MORE_FAMILIES = {
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"]),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      shared_expert_intermediate_size=64),
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, n_group=1,
                        topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
}


@pytest.mark.parametrize("architecture", MORE_FAMILIES)
def test_other_moe_families_match_single_process(launch_once, common_args, tmp_path_factory, architecture):
    model = write_tiny_model(tmp_path_factory.mktemp(architecture), architecture=architecture,
                             **MOE_SIZES, **MORE_FAMILIES[architecture])
    args = with_model([*common_args, "--max-steps", 6], model)
    reference = launch_once("01", [*args, "-b", 8])
    assert_same_training(launch_once("11", [*args, "-b", 4, "--ep", 2, *NO_AUX_LOSS], nproc=2), reference)


@pytest.mark.parametrize("flags", [["-b", 2, "--replicate-degree", 2], ["-b", 2, "--cpu-offload"]],
                         ids=["hsdp", "cpu-offload"])
def test_hsdp_and_cpu_offload_under_expert_parallelism_match_single_process(launch, flags):
    """4 ranks as (dp, ep) = (2, 2): HSDP (2 replicas of everything but the experts, each sharded over 2 ranks);
    the shards in CPU memory. Accumulation under ep (micro-batches that each exchange their tokens) is
    tests/test_masked_labels.py's chapter 11 layout."""
    assert_same_training(launch("11", "mixtral", 4, ["--ep", 2, *flags, *NO_AUX_LOSS]), launch("01", "mixtral"))


def test_a_fresh_init_gives_every_rank_its_own_piece_of_the_experts_also_under_hsdp(models, tiny_dataset,
                                                                                   tmp_path):
    """A fresh model (no --from-pretrained) at (dp, ep) = (2, 2) with HSDP over 2 replicas: ranks 0 and 2 share
    an FSDP shard index but hold the two halves (dim 1) of the same experts. Exported after one step at a
    learning rate that moves nothing: each expert's halves differ, and the weights have the init's spread."""
    run = run_chapter("11", ["-m", models["mixtral"], "-d", tiny_dataset, "-s", 32, "--dtype", "float32", "-b", 2,
                             "--ep", 2, "--replicate-degree", 2, "--max-steps", 1, "--lr", 1e-30],
                      tmp_path, nproc=4)
    model = transformers.AutoModelForCausalLM.from_pretrained(run.exp_dir / "hf", dtype=torch.float32)
    weights = {name: weight for name, weight in model.named_parameters() if ".experts." in name}
    assert sorted(name.split(".")[-1] for name in weights) == ["down_proj"] * 2 + ["gate_up_proj"] * 2
    for name, weight in weights.items():
        for expert in weight:  # [2 x intermediate, hidden] or [hidden, intermediate]: edp's halves are dim 0
            first_half, second_half = expert.chunk(2, dim=0)
            assert not torch.equal(first_half, second_half), name
            assert abs(expert.std().item() / 0.02 - 1) < 0.2, name  # HF's normal(0, 0.02)


@pytest.mark.parametrize("ep", [2, 4])
def test_with_the_load_balancing_loss_ep_2_and_4_train_as_ep_1(launch, ep):
    """4 ranks at -b 2, the config's router_aux_loss_coef (0.001, turned up to 0.1 to weigh): the loss each rank
    computes over its own tokens does not depend on where the experts are, nor do its gradients."""
    reference = launch("11", "mixtral", 4, ["--ep", 1, *AUX_LOSS_ON])
    run = launch("11", "mixtral", 4, ["--ep", ep, *AUX_LOSS_ON])
    assert_same_training(run, reference)
    differences = [abs(mine["aux_loss"] - theirs["aux_loss"])
                   for mine, theirs in zip(run.metrics, reference.metrics)]
    assert max(differences) < 1e-6, differences
    # the loss is on: it is not chapter 01's run (aux 0), and it is the model's (about top_k for a uniform router)
    assert abs(run.metrics[-1]["loss"] - launch("01").metrics[-1]["loss"]) > 1e-4
    assert 1.0 < run.metrics[0]["aux_loss"] < 4.0


def test_the_load_balancing_loss_is_k_when_balanced_and_pools_the_layers():
    """What 11's README says of aux_loss (transformers' Mixtral loss, which Qwen3-MoE shares): about k, the experts
    a token takes, for an even router; and one layer that sends every token to experts 0 and 1 beside another
    that sends them to 2 and 3 reads as balanced, since the layers' rows are counted together."""
    experts, k, tokens = 4, 2, 4096
    even = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(0)) * 1e-3
    assert load_balancing_loss_func((even,), experts, k).item() == pytest.approx(k, rel=0.01)
    to_0_and_1 = torch.tensor([4.0, 4.0, 0.0, 0.0]).expand(tokens, experts)
    to_2_and_3 = torch.tensor([0.0, 0.0, 4.0, 4.0]).expand(tokens, experts)
    one_layer = load_balancing_loss_func((to_0_and_1,), experts, k).item()
    pooled = load_balancing_loss_func((to_0_and_1, to_2_and_3), experts, k).item()
    assert one_layer > 1.9 * k and pooled == pytest.approx(k, rel=0.01), (one_layer, pooled)


@pytest.mark.parametrize("layout", ["dp1-ep2", "dp1-ep4"])
def test_a_rank_computes_with_1_over_ep_of_each_layers_experts(launch, layout):
    """Measured in every MoE layer's forward (tests/inject.py expert-bytes): the expert weights a rank holds
    while it computes are its ep group's share, whole experts, not the layer's (chapter 04 gathers them all)."""
    nproc, flags = LAYOUTS[layout]
    run = launch("11", "mixtral", nproc, [*flags, *NO_AUX_LOSS, "--max-steps", 1], script=INJECT,
                 env=inject_env("11", "expert-bytes"))
    ep = flags[flags.index("--ep") + 1]
    held = expert_bytes(run)
    assert sorted(held) == list(range(nproc))
    for numbers in held.values():
        assert numbers["held"] * ep == numbers["layer"], numbers
    everything = expert_bytes(launch("04", "mixtral", 2, ["-b", 4, "--max-steps", 1], script=INJECT,
                                     env=inject_env("04", "expert-bytes")))
    assert all(numbers["held"] == numbers["layer"] for numbers in everything.values()), everything


def expert_bytes(run):
    return {int(line.split()[1].rstrip(":")): json.loads(line.split("expert_bytes ", 1)[1])
            for line in run.stdout.splitlines() if " expert_bytes " in line}


def test_the_exchange_sends_what_the_readme_formula_says_and_validation_is_counted_apart(launch, models):
    """tests/inject.py all-to-all-bytes at (dp, ep) = (1, 2): each training step a rank sends about
    4 x L x T x k x h x a x (ep - 1) / ep bytes (11's README; the router's imbalance moves it a little), and the
    final validation pass is reported under its own key, not as a step of its own."""
    nproc, flags = LAYOUTS["dp1-ep2"]
    run = launch("11", "mixtral", nproc, [*flags, *NO_AUX_LOSS, "--max-steps", 2], script=INJECT,
                 env=inject_env("11", "all-to-all-bytes"))
    sent = [json.loads(line.split("all_to_all_bytes ", 1)[1]) for line in run.stdout.splitlines()
            if " all_to_all_bytes " in line]
    assert len(sent) == nproc and all(set(by_step) == {"1", "2", "validation after 2"} for by_step in sent), sent
    config = transformers.AutoConfig.from_pretrained(models["mixtral"])
    tokens_per_rank = flags[flags.index("-b") + 1] * 32  # -s 32 in common_args
    formula = (4 * config.num_hidden_layers * tokens_per_rank * config.num_experts_per_tok * config.hidden_size
               * 4 * (2 - 1) / 2)
    measured = [by_step[step] for by_step in sent for step in ("1", "2")]
    assert sum(measured) / len(measured) == pytest.approx(formula, rel=0.2), (measured, formula)


@pytest.mark.parametrize("ep", [1, 4])
def test_an_ep2_checkpoint_resumes_on_other_ep_sizes(launch, common_args, models, tmp_path, ep):
    """Stopped after step STOP_AFTER at (dp, ep) = (2, 2) with the load-balancing loss on, resumed on the same 4
    ranks at ep 1 and at ep 4: the losses (both) go on as the uninterrupted run's, to rounding (DCP reshards
    the experts). The same ranks and -b: each rank's load-balancing loss is over its own micro-batch."""
    stopped = launch("11", "mixtral", 4, ["--ep", 2, *AUX_LOSS_ON], expect_ok=False, script=INJECT,
                     env=inject_env("11", "sigterm", after_step=STOP_AFTER))
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    assert [p.name for p in (stopped.exp_dir / "checkpoints").iterdir()] == [f"step-{STOP_AFTER:08d}"]
    shutil.copytree(stopped.exp_dir, tmp_path / "outputs" / "test")
    args = with_model([*common_args, "--max-steps", STEPS, "--ep", ep, *AUX_LOSS_ON], models["mixtral"])
    resumed = run_chapter("11", args, tmp_path, nproc=4)
    assert f"at step {STOP_AFTER}" in resumed.stdout
    uninterrupted = launch("11", "mixtral", 4, ["--ep", 2, *AUX_LOSS_ON])
    assert_same_training(resumed, uninterrupted)
    differences = [abs(mine["aux_loss"] - theirs["aux_loss"])
                   for mine, theirs in zip(resumed.metrics, uninterrupted.metrics)]
    assert max(differences) < 1e-6, differences


def test_the_export_is_the_ordinary_model(launch):
    """The export names no experts forward of ours: from_pretrained builds it with transformers' own, in a
    process that never registered ExpertParallel, and it computes what chapter 01's trained model computes."""
    nproc, flags = LAYOUTS["dp1-ep2"]
    exported = launch("11", "mixtral", nproc, [*flags, *NO_AUX_LOSS]).exp_dir / "hf"
    reference = launch("01", "mixtral").exp_dir / "hf"
    assert "expert_parallel" not in (exported / "config.json").read_text()
    models = [transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
              for path in (exported, reference)]
    assert type(models[0]).__name__ == "MixtralForCausalLM"
    input_ids = torch.randint(3, 200, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (models[0](input_ids).logits - models[1](input_ids).logits).abs().max() < 1e-4


@pytest.mark.parametrize("flags,model,message", [
    (["--ep", 3], "mixtral",
     "--ep 3 does not divide the 2 ranks; pass a divisor of the number of ranks (an ep group is best kept "
     "inside one node: all_to_all crosses it in every layer)"),
    (["--ep", 2], "three-experts",
     "--ep 2 does not divide the 3 experts of each layer; pass a divisor of the number of experts"),
    (["--ep", 2], "llama",
     "LlamaForCausalLM has no experts module that this chapter can split (the fused experts of Mixtral, "
     "Qwen3-MoE, GPT-OSS and the like); train this model with chapter 04"),
], ids=["ranks", "experts", "dense-model"])
def test_bad_layouts_fail_with_one_line_on_every_rank(common_args, models, tiny_model, tmp_path, flags, model,
                                                       message):
    paths = {**models, "llama": tiny_model,
             "three-experts": write_tiny_model(tmp_path / "three", architecture="mixtral", num_local_experts=3,
                                               **MOE_SIZES)}
    args = with_model([*common_args, *flags], paths[model])
    run = run_chapter("11", args, tmp_path, nproc=2, expect_ok=False, timeout=90)
    assert run.returncode != 0
    assert run.worker_stderr.count(f"error: {message}") == 2, run.stderr[-3000:]
    assert 'train_llm.py", line' not in run.stderr  # no traceback from the script
    assert not (run.exp_dir / "checkpoints").exists()


@pytest.mark.parametrize("coef,config,message", [
    (-1, transformers.MixtralConfig(),
     "--aux-loss-coef -1.0 is negative; pass 0 (no load-balancing loss) or more"),
    (0.01, transformers.DeepseekV3Config(),
     "deepseek_v3 defines no load-balancing loss to add; pass --aux-loss-coef 0"),
], ids=["negative", "no-aux-loss"])
def test_a_load_balancing_loss_that_cannot_be_added_is_refused_with_one_line(coef, config, message):
    script = load_script(CHAPTERS["11"] / "train_llm.py")
    args = script["get_parser"]().parse_args(["--aux-loss-coef", str(coef)])
    with pytest.raises(SystemExit) as stopped:
        script["check_expert_parallel_fits"](args, config, 2)
    assert str(stopped.value) == f"error: {message}"


def test_the_default_coefficient_is_the_configs():
    script = load_script(CHAPTERS["11"] / "train_llm.py")
    args = script["get_parser"]().parse_args([])
    script["check_expert_parallel_fits"](args, transformers.MixtralConfig(router_aux_loss_coef=0.02), 2)
    assert args.aux_loss_coef == 0.02


@pytest.mark.parametrize("architecture", ["mixtral", "gpt_oss"])
def test_the_experts_forward_equals_transformers_own(architecture):
    """One rank (ep 1), in process: ExpertParallel's forward on a Mixtral layer's experts and on GPT-OSS's
    (transposed weights, biases, interleaved and clamped gate) gives transformers' eager output and gradients."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    script = load_script(CHAPTERS["11"] / "train_llm.py")
    config = {"mixtral": transformers.MixtralConfig, "gpt_oss": transformers.GptOssConfig}[architecture](
        hidden_size=32, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    experts = script["expert_modules"](model)[0]
    generator = torch.Generator().manual_seed(1)
    hidden_states = torch.randn(20, 32, generator=generator, requires_grad=True)
    top_k_index = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(20)])
    top_k_weights = torch.rand(20, 2, generator=generator)
    expected = experts(hidden_states, top_k_index, top_k_weights)
    expected.sum().backward()
    expected_grads = [hidden_states.grad, *(w.grad for w in experts.parameters())]

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
        for name, weight in list(experts.named_parameters()):
            sharded = distribute_tensor(weight.detach(), mesh, [Shard(0)])
            experts.register_parameter(name, torch.nn.Parameter(sharded))
        hidden_states.grad = None
        expert_parallel = script["ExpertParallel"](model, dist.group.WORLD, torch.device("cpu"))
        ours = expert_parallel(experts, hidden_states, top_k_index, top_k_weights)
        ours.sum().backward()
        our_grads = [hidden_states.grad, *(w.grad.to_local() for w in experts.parameters())]
    finally:
        dist.destroy_process_group()
    assert (ours - expected).abs().max() < 1e-5
    for mine, theirs in zip(our_grads, expected_grads):
        assert (mine - theirs).abs().max() < 1e-5
