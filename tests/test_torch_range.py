"""The torch range the chapters support: CI trains them on both ends (.ci/torch-range.sh), the README and
requirements.txt state it, every script knows it, and a torch older than its oldest end gets one warning line."""
import io
import re
from contextlib import redirect_stderr

import pytest
import torch
from torch.torch_version import TorchVersion

from conftest import CHAPTERS, ROOT
from launching import load_script

SCRIPTS = {name: folder / "train_llm.py" for name, folder in CHAPTERS.items() if (folder / "train_llm.py").exists()}


def ci_ends():
    """{"oldest": (torch, transformers), "newest": (...)} as .ci/torch-range.sh installs them."""
    text = (ROOT / ".ci" / "torch-range.sh").read_text()
    found = re.findall(r"^\s*(oldest|newest)\) torch=(\S+) transformers=(\S+) ;;", text, re.MULTILINE)
    ends = {end: (torch_version, transformers_version) for end, torch_version, transformers_version in found}
    assert set(ends) == {"oldest", "newest"}, text
    return ends


def minor(version):
    return ".".join(version.split(".")[:2])


def test_ci_runs_both_ends_of_the_torch_range_and_every_script_names_them():
    ends = ci_ends()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "for end in oldest newest; do" in ci and 'bash .ci/torch-range.sh "$end"' in ci
    tested = (minor(ends["oldest"][0]), minor(ends["newest"][0]))
    for name, script in SCRIPTS.items():
        assert load_script(script)["TESTED_TORCH"] == tested, name
    oldest, newest = ends["oldest"][0], ends["newest"][0]
    assert f"torch {oldest} to {newest}" in " ".join((ROOT / "README.md").read_text().split())
    assert f"torch {oldest} to {newest}" in (ROOT / "requirements.txt").read_text()
    pinned = re.search(r"^torch==(\S+)", (ROOT / "requirements.txt").read_text(), re.MULTILINE).group(1)
    assert TorchVersion(oldest) <= TorchVersion(pinned) <= TorchVersion(newest)


@pytest.mark.parametrize("chapter", sorted(SCRIPTS))
def test_a_torch_older_than_the_oldest_tested_gets_one_warning_line(chapter, monkeypatch, tmp_path):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")  # as torchrun sets it (chapter 01 runs without)
    script = load_script(SCRIPTS[chapter])
    oldest, newest = script["TESTED_TORCH"]
    args = script["get_parser"]().parse_args(["--save-dir", str(tmp_path)])
    outputs = {}
    for version in ("2.10.0+cu128", f"{oldest}.0+cu130", f"{newest}.1", torch.__version__):
        monkeypatch.setattr(torch, "__version__", TorchVersion(version))
        with redirect_stderr(io.StringIO()) as stderr:
            script["check_args"](args)
        outputs[version] = stderr.getvalue()
    assert outputs["2.10.0+cu128"] == (
        f"warning: torch 2.10.0+cu128 is older than the releases these scripts are tested on ({oldest} to "
        f"{newest}); if a step fails, install torch {oldest} or newer\n"
    )
    assert not any(output for version, output in outputs.items() if version != "2.10.0+cu128")
