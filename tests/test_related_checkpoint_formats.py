"""related-topics/checkpoint-formats: convert_checkpoint.py turns chapter 04's sharded DCP checkpoint into a
Hugging Face model and into one torch.save file, and a Hugging Face model into DCP, losing nothing.

The checkpoint is the one tests/test_04_fsdp.py's 2-rank run writes at its last step (the same launch, shared
through launch_once); that run also exports hf/ at that step, gathered by chapter 04 itself: an independent
reference the conversions must equal bit for bit (fp32, the same tensors, only moved between files).
"""
import runpy
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers
from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

from conftest import CHAPTERS, INJECT, ROOT, inject_env, load_weights, offline_env
from launching import load_script

# NOTE: the tests read DCP checkpoints in one process, on purpose (as the converter does).
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")
CONVERTER = ROOT / "related-topics" / "checkpoint-formats" / "convert_checkpoint.py"
STEPS = 12


@pytest.fixture(scope="module")
def fsdp_run(launch_once, common_args):
    """tests/test_04_fsdp.py's fsdp_two_ranks launch: 2 ranks, -b 4, 12 steps, through tests/inject.py."""
    return launch_once("04", [*common_args, "--max-steps", STEPS, "-b", 4], nproc=2, script=INJECT,
                       env=inject_env("04", "shard-bytes"))


@pytest.fixture(scope="module")
def checkpoint(fsdp_run):
    return fsdp_run.exp_dir / "checkpoints" / f"step-{STEPS:08d}"


def converted(command, source, output, *flags):
    """Run convert_checkpoint.py as __main__ with these arguments, in this process (torch and transformers are
    imported already: 3-4 s saved a conversion); returns the path it wrote."""
    argv = sys.argv
    sys.argv = [str(CONVERTER), command, str(source), str(output), *map(str, flags)]
    try:
        runpy.run_path(str(CONVERTER), run_name="__main__")
    finally:
        sys.argv = argv
    return output


def dcp_entries(checkpoint):
    """{key: shape} of every tensor a DCP checkpoint holds, from its .metadata alone."""
    metadata = dcp.FileSystemReader(checkpoint).read_metadata()
    entries = metadata.state_dict_metadata.items()
    return {key: list(value.size) for key, value in entries if hasattr(value, "size")}


def test_dcp_checkpoint_converts_to_a_hf_model_with_the_exports_logits(checkpoint, fsdp_run, tiny_model,
                                                                        tmp_path):
    hf_dir = converted("dcp-to-hf", checkpoint, tmp_path / "hf", "-m", tiny_model)

    models = [transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
              for path in (hf_dir, fsdp_run.exp_dir / "hf")]
    input_ids = transformers.AutoTokenizer.from_pretrained(hf_dir)(
        ["red green blue cat dog", "bird runs sits sings"], padding=True, return_tensors="pt"
    ).input_ids
    with torch.no_grad():
        logits = [model(input_ids).logits for model in models]
    assert torch.equal(logits[0], logits[1])
    # the same tensors, written by the same save_pretrained: the very bytes of chapter 04's own export
    exported_file = fsdp_run.exp_dir / "hf" / "model.safetensors"
    assert (hf_dir / "model.safetensors").read_bytes() == exported_file.read_bytes()


def test_dcp_checkpoint_converts_to_one_torch_save_file_holding_every_tensor(checkpoint, fsdp_run, tmp_path):
    saved = torch.load(converted("dcp-to-torch", checkpoint, tmp_path / "one.pt"), weights_only=True)

    assert sorted(saved) == ["model", "optimizer"]
    exported = load_weights(fsdp_run.exp_dir / "hf")
    assert saved["model"].keys() == exported.keys()
    assert all(torch.equal(saved["model"][name], exported[name]) for name in exported)
    # AdamW's state for every weight, whole: the two moments and the step counter
    state = saved["optimizer"]["state"]
    assert state.keys() == exported.keys()
    assert all(state[name]["exp_avg"].shape == exported[name].shape and state[name]["step"] == STEPS
               for name in exported)
    # and back: torch's inverse writes a DCP checkpoint with the same tensors under the same keys
    torch_save_to_dcp(tmp_path / "one.pt", tmp_path / "dcp-again")
    assert dcp_entries(tmp_path / "dcp-again") == dcp_entries(checkpoint)


def test_hf_model_converts_to_a_dcp_checkpoint_that_loads_back_equal(checkpoint, fsdp_run, tmp_path):
    dcp_dir = converted("hf-to-dcp", fsdp_run.exp_dir / "hf", tmp_path / "dcp")

    # the keys and shapes of the model part of chapter 04's own checkpoint, so its dcp.load finds every tensor
    model_entries = {key: shape for key, shape in dcp_entries(checkpoint).items() if key.startswith("model.")}
    assert dcp_entries(dcp_dir) == model_entries
    exported = load_weights(fsdp_run.exp_dir / "hf")
    loaded = {"model": {name: torch.empty_like(tensor) for name, tensor in exported.items()}}
    dcp.load(loaded, checkpoint_id=dcp_dir)
    assert all(torch.equal(loaded["model"][name], exported[name]) for name in exported)


def test_a_folder_that_is_not_a_checkpoint_fails_with_one_line(fsdp_run, tmp_path):
    # the experiment folder instead of one of its checkpoints; a real process, for its exit status and stderr
    result = subprocess.run([sys.executable, CONVERTER, "dcp-to-hf", fsdp_run.exp_dir, tmp_path / "hf"],
                            cwd=tmp_path, env=offline_env(tmp_path), capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 1
    assert result.stderr == (f"error: '{fsdp_run.exp_dir}' is not a DCP checkpoint (no .metadata file in "
                             "it); pass a checkpoints/step-N folder written by chapter 04\n")
    assert not (tmp_path / "hf").exists()


def test_a_checkpoint_of_another_model_than_m_fails_with_one_line(checkpoint, tmp_path):
    # no -m: the default tiny Llama is wider than the test's model, and nothing is silently reshaped
    with pytest.raises(SystemExit) as stop:
        converted("dcp-to-hf", checkpoint, tmp_path / "hf")
    assert stop.value.code == (f"error: checkpoint '{checkpoint}' holds a different model than the tiny "
                               "Llama (lm_head.weight: [272, 64] in the checkpoint, [272, 128] in the "
                               "model); pass the -m it was trained with")
    assert not (tmp_path / "hf").exists()


def test_default_model_is_the_chapters_tiny_llama():
    converter, chapter = (load_script(path) for path in (CONVERTER, CHAPTERS["04"] / "train_llm.py"))
    assert converter["tiny_llama_config"]().to_dict() == chapter["tiny_llama_config"]().to_dict()
