"""Chapter 06: tensor parallelism (with sequence and loss parallelism) trains the same model to the same numbers
as chapter 01 on one process with the same -b (every TP rank sees the whole batch), resumes with its Adam state,
starts from chapter 01's initial weights, and refuses a model that does not split over the ranks.

TP sums partial matmul results in a different order than one process does: numbers agree to the rounding
tolerances of tests/conftest.py.
"""
import json
import math

import pytest

from conftest import (
    CHAPTERS, INJECT, assert_same_training, inject_env, load_weights, run_chapter, write_tiny_model,
)

# NOTE: -b 8 on every TP rank is the batch that chapter 01 sees at -b 8. 10 steps, warmup 2, cosine after.
PARITY = ["-b", 8, "--max-steps", 10]

# NOTE: a probe, not a mock: it runs the chapter script unchanged (as __main__), and when the script gathers the
# model for its Hugging Face export, first compares every replicated parameter across ranks and writes a report.
REPLICA_PROBE = '''
import json, os, runpy, sys
import torch, torch.distributed as dist
import torch.distributed.checkpoint.state_dict as dcp_state_dict
from torch.distributed.tensor import DTensor, Replicate

script, report_path = os.environ["TRAIN_SCRIPT"], os.environ["REPLICA_REPORT"]
real_get_model_state_dict = dcp_state_dict.get_model_state_dict

def compare_replicas_then_gather(model, *args, **kwargs):
    report = {"plain_tensors": [], "replicated_max_diff": {}}
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            report["plain_tensors"].append(name)
        elif all(isinstance(placement, Replicate) for placement in param.placements):
            local = param.to_local().detach()
            copies = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(copies, local)
            report["replicated_max_diff"][name] = max((c - copies[0]).abs().max().item() for c in copies)
    if dist.get_rank() == 0:
        with open(report_path, "w") as f:
            json.dump(report, f)
    return real_get_model_state_dict(model, *args, **kwargs)

dcp_state_dict.get_model_state_dict = compare_replicas_then_gather
sys.argv = [script, *sys.argv[1:]]
sys.path[0] = os.path.dirname(os.path.abspath(script))
runpy.run_path(script, run_name="__main__")
'''


@pytest.fixture
def single_process(common_args, launch_once):
    return launch_once("01", [*common_args, *PARITY])


@pytest.fixture
def tp2(common_args, launch_once):
    return launch_once("06", [*common_args, *PARITY], nproc=2)


def test_compile_trains_as_single_process_does(single_process, common_args, launch_once):
    """--compile compiles each block of the parallelized model (chapter 07 keeps these lines)."""
    assert_same_training(launch_once("06", [*common_args, *PARITY, "--compile"], nproc=2), single_process, 10)


@pytest.mark.parametrize("nproc", [2, 4])
def test_tp_matches_single_process_loss_and_weights(nproc, single_process, common_args, launch_once):
    assert_same_training(launch_once("06", [*common_args, *PARITY], nproc=nproc), single_process, 10)


@pytest.mark.parametrize("architecture,overrides", [
    ("qwen3", {}), ("gemma2", {}), ("gemma3", {}), ("llama", {"tie_word_embeddings": True}),
], ids=["qwen3-per-head-norms", "gemma2-without-sdpa", "gemma3-norms-around-the-mlp", "llama-tied-embeddings"])
def test_other_architectures_match_single_process(architecture, overrides, common_args, launch_once, tmp_path):
    """Qwen3 normalises each head's queries and keys (q_norm, k_norm: parameters a Llama plan does not place),
    Gemma 3 also the MLP's input and output; a tied model shares one matrix between embedding and head. Gemma 2
    has no sdpa attention in transformers: both scripts must pick eager by default."""
    model = write_tiny_model(tmp_path / architecture, architecture=architecture, **overrides)
    args = [*common_args, *PARITY, "-m", model]
    assert_same_training(run_chapter("06", args, tmp_path, nproc=2, experiment="tp"),
                         run_chapter("01", args, tmp_path, experiment="single"), 10)


def test_sigterm_then_relaunch_restores_adam_state(tp2, common_args, tmp_path):
    args = [*common_args, *PARITY]
    stopped = run_chapter("06", args, tmp_path, nproc=2, script=INJECT, env=inject_env("06", "sigterm", after_step=4),
                          expect_ok=False)
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    assert "stopped by a signal after step 4; relaunch the same command to resume" in stopped.stderr
    assert [p.name for p in (stopped.exp_dir / "checkpoints").iterdir()] == ["step-00000004"]

    resumed = run_chapter("06", args, tmp_path, nproc=2)
    assert "resumed from" in resumed.stdout and "at step 4" in resumed.stdout
    # Steps 5-10 after a relaunch equal the uninterrupted run's. With Adam's moments lost (measured by loading a
    # fresh optimizer state instead), step 6 is off by 0.036 and every later step by about 0.03.
    assert_same_training(resumed, tp2, 10, first_step=5)


@pytest.fixture(scope="module")
def fresh_init(tiny_dataset, tmp_path_factory):
    """Chapter 01 and chapter 06 (2 ranks) from fresh weights (no --from-pretrained) on a model wide enough for
    per-tensor statistics, with the embedding tied to the output head (as in Llama 3.2 1B)."""
    tmp_path = tmp_path_factory.mktemp("fresh")
    model = write_tiny_model(tmp_path / "wide", hidden_size=256, intermediate_size=512, tie_word_embeddings=True)
    # NOTE: 3 steps move each weight by at most 3 * lr = 3e-3, little against the init's std of 0.02, and enough
    # to separate a tied embedding from an untied one (each would get different updates).
    args = ["-m", model, "-d", tiny_dataset, "-s", 32, "--dtype", "float32", "--log-freq", 1, "-b", 4,
            "--max-steps", 3, "--warmup-steps", 1]
    single = run_chapter("01", args, tmp_path, experiment="single")
    env = {"TRAIN_SCRIPT": str(CHAPTERS["06"] / "train_llm.py"), "REPLICA_REPORT": str(tmp_path / "replicas.json")}
    probe = tmp_path / "replica_probe.py"
    probe.write_text(REPLICA_PROBE)
    tp = run_chapter("06", args, tmp_path, nproc=2, script=probe, env=env, experiment="tp")
    return single, tp, json.loads((tmp_path / "replicas.json").read_text())


def test_fresh_init_equals_single_process_init(fresh_init):
    single, tp, _ = fresh_init
    single_weights, tp_weights = load_weights(single.exp_dir / "hf"), load_weights(tp.exp_dir / "hf")
    for name, reference in single_weights.items():
        # HF's init: normal(0, 0.02) matrices, ones in the norms. Same distribution (std within 5%)...
        assert abs(tp_weights[name].std() / reference.std() - 1) < 0.05, name
        assert abs(tp_weights[name].mean() - reference.mean()) < 1e-3, name
    # ...and in fact the same weights: every rank builds chapter 01's model from the same seed, then slices it.
    assert_same_training(tp, single, 3)
    assert math.isclose(tp.losses[0], math.log(272), abs_tol=0.3), tp.losses[0]


def test_replicated_parameters_are_identical_on_every_rank(fresh_init):
    _, _, replicas = fresh_init
    # With sequence parallelism every parameter is a DTensor (clip_grad_norm_ needs that); the norms are replicated.
    assert replicas["plain_tensors"] == []
    assert any("layernorm" in name for name in replicas["replicated_max_diff"]), replicas
    assert all(diff == 0 for diff in replicas["replicated_max_diff"].values()), replicas


def test_tied_embedding_stays_tied(fresh_init):
    _, tp, _ = fresh_init
    weights = load_weights(tp.exp_dir / "hf")
    # HF writes a tied matrix once; two different matrices would mean that TP untied them.
    assert "lm_head.weight" not in weights or (weights["lm_head.weight"] == weights["model.embed_tokens.weight"]).all()


def test_model_that_does_not_divide_fails_fast_on_every_rank_naming_every_size_and_the_ones_that_work(
    tiny_dataset, tmp_path
):
    model = write_tiny_model(tmp_path / "six-heads", hidden_size=96, num_attention_heads=6, num_key_value_heads=6)
    run = run_chapter("06", ["-m", model, "-d", tiny_dataset, "-s", 34], tmp_path, nproc=4, expect_ok=False)
    assert run.returncode != 0
    # 4 ranks: 6 heads, 6 kv heads and 34 tokens do not divide by 4 (128 MLP channels and 272 entries do); all
    # of them divide by 1 and 2 only.
    message = ("error: tensor parallelism over 4 ranks splits sizes that do not divide by 4: 6 attention heads, "
               "6 key/value heads, 34 tokens per sequence (-s, split by sequence parallelism); launch with "
               "--nproc_per_node 1, 2 (these divide them all)")
    # Both ranks exit with the message (torchrun shows each failed rank's error), none hangs (timeout).
    assert run.worker_stderr.count(message) == 4, run.stderr[-3000:]
    assert not (run.exp_dir / "checkpoints").exists()


def test_a_sequence_length_that_does_not_divide_is_named_as_a_way_out(tiny_dataset, tmp_path):
    # The shape of SmolLM2-135M (9 heads, 3 key/value heads): 3 ranks split the model, -s 128 not; -s 126 would.
    model = write_tiny_model(tmp_path / "nine-heads", hidden_size=144, num_attention_heads=9, num_key_value_heads=3,
                             intermediate_size=384, vocab_size=288)
    run = run_chapter("06", ["-m", model, "-d", tiny_dataset, "-s", 128], tmp_path, nproc=3, expect_ok=False)
    message = ("error: tensor parallelism over 3 ranks splits sizes that do not divide by 3: 128 tokens per "
               "sequence (-s, split by sequence parallelism); launch with --nproc_per_node 1 (these divide them "
               "all), or --nproc_per_node 3 with -s 126")
    assert run.worker_stderr.count(message) == 3, run.stderr[-3000:]
