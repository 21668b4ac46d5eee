"""related-topics/mfu-and-memory: the bytes that memory_arithmetic.py predicts for weights, gradients and
AdamW state are the bytes the tensors hold after a step; bf16 autocast saves a bf16 copy of every matmul
weight; and the README's FLOP formula is chapter 01's count, for the tiny model and Llama 3.1 8B's shape."""
import re

import pytest
import torch
import transformers

from conftest import CHAPTERS, ROOT
from launching import load_script

FOLDER = ROOT / "related-topics" / "mfu-and-memory"
README = (FOLDER / "README.md").read_text()
# Llama 3.1 8B's shape (its config.json on the Hub), built on the meta device: no memory, no download.
LLAMA_3_1_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072)


@pytest.fixture(scope="module")
def arithmetic():
    return load_script(FOLDER / "memory_arithmetic.py")


@pytest.fixture(scope="module")
def chapter_01_flops():
    return load_script(CHAPTERS["01"] / "train_llm.py")["training_flops_per_token"]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_predicted_state_bytes_equal_the_tensors_after_an_adamw_step(arithmetic, tied):
    torch.manual_seed(0)
    model = arithmetic["build_tiny_model"](tied)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    arithmetic["train_step"](model, optimizer, 2, 16)
    # counted here, not by the script: every tensor the model and the optimizer hold, each storage once
    storages = {}
    for tensor in [*model.parameters(), *(p.grad for p in model.parameters()),
                   *(t for state in optimizer.state.values() for t in state.values())]:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    params = list(model.parameters())
    predicted = arithmetic["predicted_state_bytes"](sum(p.numel() for p in params), len(params))
    assert sum(storages.values()) == sum(predicted.values())
    assert arithmetic["measured_state_bytes"](model, optimizer) == predicted
    assert sum(predicted.values()) // sum(p.numel() for p in params) == 16


def test_bf16_autocast_saves_a_bf16_copy_of_every_matmul_weight(arithmetic):
    model = arithmetic["build_tiny_model"](False)
    matmul_weights = sum(p.numel() for name, p in model.named_parameters() if "norm" not in name
                         and "embed_tokens" not in name)
    _, fp32_constant = arithmetic["activation_bytes"](model, 2, 16, "float32")
    per_token, bf16_constant = arithmetic["activation_bytes"](model, 2, 16, "bfloat16")
    # NOTE: the constant part is what does not grow with the tokens: in fp32 a few small index tensors
    # (68 bytes measured), under autocast also the bf16 casts of the weights, 2 bytes each, kept for backward.
    assert fp32_constant < 1024
    assert bf16_constant - fp32_constant == 2 * matmul_weights
    assert per_token > 0


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_readme_flop_formula_is_chapter_01s_count(arithmetic, chapter_01_flops, tied):
    config = transformers.LlamaConfig(**{**LLAMA_3_1_8B, "tie_word_embeddings": tied})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    num_params = sum(p.numel() for p in model.parameters())
    formula = arithmetic["flops_per_token"](num_params, config.vocab_size, config.hidden_size,
                                            config.num_hidden_layers, 8192, tied)
    assert formula == chapter_01_flops(model, config, 8192)
    if not tied:
        # the README's worked example: Llama 3.1 8B at 8192 tokens, and torchtitan's 5,762 tokens/s per H100
        assert f"{formula / 1e9:.1f} GFLOPs per token" in README
        assert f"{5762 * formula / 989e12:.1%}" in README


def test_readme_tiny_model_numbers_are_the_scripts(arithmetic, chapter_01_flops):
    model = arithmetic["build_tiny_model"](False)
    flops = chapter_01_flops(model, model.config, 128)
    assert f"{flops:,} FLOPs per token" in README
    num_params, num_tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    assert f"{num_params:,} parameters" in README
    total = 16 * num_params + 4 * num_tensors
    assert re.search(rf"\| total \| {total:,} \| {total:,} \|", README)
