"""Each chapter script is its parent chapter's script plus the lines of one technique: the diffs stay small, and
every helper that the technique does not touch is the same text in both. Also checks the one piece of
arithmetic every chapter shares, the FLOP count behind MFU, against a count by hand."""
import ast
import re
import subprocess

import pytest
import torch
import transformers

from conftest import CHAPTERS, TINY_LLAMA
from launching import load_script

# (parent, chapter): the most changed lines `diff parent chapter` may show, and the functions that carry the
# technique (all others must be identical). The top README prints these numbers.
CHAPTER_DIFFS = {
    # Every rank enters a checkpoint save: rank 0 writes the one file, each rank checksums what it wrote and
    # checks its share on resume.
    ("01", "02"): (155, {"main", "run_on_rank_0", "usable_checkpoint", "write_manifest", "checkpoint_folder",
                         "save_checkpoint"}),
    ("02", "04"): (220, {"main", "make_device_mesh", "build_model", "shard_model", "transformer_blocks",
                         "initialize_weights", "load_pretrained_weights", "save_checkpoint", "load_checkpoint",
                         "export_hf", "get_parser"}),
    ("04", "05"): (110, {"main", "get_parser", "build_model", "shard_model", "load_pretrained_weights"}),
    # Tensor parallelism replaces DDP and takes chapter 04's DCP checkpoints and export (BORROWED below).
    ("02", "06"): (210, {"main", "check_tensor_parallel_fits", "tensor_parallelize", "save_checkpoint",
                         "load_checkpoint", "export_hf"}),
    ("06", "07"): (60, {"main", "get_parser", "shard_model", "make_device_mesh", "check_tensor_parallel_fits"}),
    # A pipeline replaces the model's forward and backward with a schedule, and each rank's checkpoint part and
    # export cover its stages: chapter 04's DCP format, under the whole model's names.
    ("02", "08"): (305, {"main", "get_parser", "save_checkpoint", "load_checkpoint", "export_hf"}),
    ("07", "09"): (355, {"main", "get_parser", "save_checkpoint", "load_checkpoint", "export_hf"}),
}
# chapter: (the chapter whose text these helpers must be, the helpers)
BORROWED = {"06": ("04", {"save_checkpoint", "load_checkpoint", "export_hf"})}
SCRIPTS = sorted({chapter for pair in CHAPTER_DIFFS for chapter in pair})


def script(chapter):
    return (CHAPTERS[chapter] / "train_llm.py").read_text()


def changed_lines(parent, chapter):
    """The lines `diff parent chapter` marks < or >: what a reader who runs diff sees."""
    paths = [CHAPTERS[name] / "train_llm.py" for name in (parent, chapter)]
    output = subprocess.run(["diff", *paths], capture_output=True, text=True).stdout
    return [line for line in output.splitlines() if line[:1] in "<>"]


def functions(source):
    """Top-level function name -> its source text."""
    return {node.name: ast.get_source_segment(source, node) for node in ast.parse(source).body
            if isinstance(node, ast.FunctionDef)}


@pytest.mark.parametrize("parent,chapter", CHAPTER_DIFFS, ids=[f"{a}-{b}" for a, b in CHAPTER_DIFFS])
def test_chapter_diff_stays_within_its_bound(parent, chapter):
    bound, _ = CHAPTER_DIFFS[parent, chapter]
    assert len(changed_lines(parent, chapter)) <= bound, (
        f"{len(changed_lines(parent, chapter))} changed lines from chapter {parent} to {chapter}"
    )


def test_the_top_readme_shows_each_diffs_real_size():
    readme = (CHAPTERS["01"].parent / "README.md").read_text()
    rows = re.findall(r"^\| (\d\d) \| (\d\d) \| (\d+) \|", readme, re.MULTILINE)
    assert {(parent, chapter) for chapter, parent, _ in rows} == set(CHAPTER_DIFFS)
    for chapter, parent, shown in rows:
        assert int(shown) == len(changed_lines(parent, chapter)), (parent, chapter, shown)


@pytest.mark.parametrize("parent,chapter", CHAPTER_DIFFS, ids=[f"{a}-{b}" for a, b in CHAPTER_DIFFS])
def test_helpers_outside_the_technique_are_the_parents_text(parent, chapter):
    _, technique = CHAPTER_DIFFS[parent, chapter]
    ours, theirs = functions(script(chapter)), functions(script(parent))
    differing = [name for name in ours.keys() & theirs.keys() - technique if ours[name] != theirs[name]]
    assert not differing, f"chapter {chapter} changes {differing} of chapter {parent}, outside its technique"


@pytest.mark.parametrize("chapter", BORROWED)
def test_borrowed_helpers_are_the_lending_chapters_text(chapter):
    lender, helpers = BORROWED[chapter]
    ours, theirs = functions(script(chapter)), functions(script(lender))
    differing = [name for name in sorted(helpers) if ours[name] != theirs[name]]
    assert not differing, f"chapter {chapter}'s {differing} differ from chapter {lender}'s"


def test_every_script_line_fits_110_characters():
    long_lines = [f"{chapter}:{number}" for chapter in SCRIPTS
                  for number, line in enumerate(script(chapter).splitlines(), 1) if len(line) > 115]
    assert not long_lines, long_lines


def hand_count(config, seq_length, tied):
    """6 FLOPs per matmul weight per token + 12 * layers * hidden * seq_length for attention scores."""
    hidden, layers, inter, vocab = config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size
    head_dim = hidden // config.num_attention_heads
    per_layer = (
        hidden * hidden  # q_proj
        + 2 * hidden * config.num_key_value_heads * head_dim  # k_proj, v_proj
        + hidden * hidden  # o_proj
        + 3 * hidden * inter  # gate, up, down
        + 2 * hidden  # two RMSNorm weights
    )
    # The output head is a matmul whether or not it shares its matrix with the embedding (a lookup).
    matmul_weights = layers * per_layer + hidden + vocab * hidden
    return 6 * matmul_weights + 12 * layers * hidden * seq_length


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chapter", SCRIPTS)
def test_flops_per_token_counts_the_output_head_also_when_tied(chapter, tied):
    flops_per_token = load_script(CHAPTERS[chapter] / "train_llm.py")["training_flops_per_token"]
    config = transformers.LlamaConfig(**{**TINY_LLAMA, "num_key_value_heads": 2, "tie_word_embeddings": tied})
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    assert flops_per_token(model, config, 128) == hand_count(config, 128, tied)


def test_mfu_divides_by_the_peak_of_the_gpu_named_not_of_a_shorter_name_inside_it(monkeypatch):
    # The names torch.cuda.get_device_name gives; "GB200" contains "B200", "GH200" contains "H200".
    expected = {"NVIDIA GB200": 2500e12, "NVIDIA B200": 2250e12, "NVIDIA GH200 480GB": 989e12,
                "NVIDIA H200 NVL": 835e12, "NVIDIA H200": 989e12, "NVIDIA H100 PCIe": 756e12,
                "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA A100-SXM4-80GB": 312e12, "Tesla T4": None}
    peak = load_script(CHAPTERS["01"] / "train_llm.py")["peak_flops_per_second"]
    for name, flops in expected.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: name)
        assert peak(torch.device("cuda", 0)) == flops, name
