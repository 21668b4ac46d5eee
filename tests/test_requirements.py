"""`pip install -r requirements.txt` installs everything the suite and the READMEs' commands import.

CI (.ci/run) builds its virtual environments from nothing on every run, so there this test proves the README's
two commands on a fresh machine: a module that only an earlier install left behind would not be found.
"""
import ast
import importlib
import re
import sys

from conftest import ROOT, tracked_files

# Imported only where the README says to install it first, each with the reason it is not in requirements.txt.
OPTIONAL = {
    "flash_attn": "GPU only, compiled against the reader's torch and CUDA (README.md, 'On real GPUs')",
}
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
IMPORT_LINE = re.compile(r"^\s*(?:import|from)\s+([A-Za-z_]\w*)", re.MULTILINE)


def imported_top_level_modules():
    """{module: a file that imports it} over every tracked .py file (imports inside functions too) and every
    ```python block of a README."""
    found = {}
    for path in tracked_files("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], path.relative_to(ROOT))
    for readme in tracked_files("*.md"):
        for block in PYTHON_BLOCK.findall(readme.read_text()):
            for name in IMPORT_LINE.findall(block):
                found.setdefault(name, readme.relative_to(ROOT))
    return found


def test_every_module_the_suite_and_the_readmes_import_is_installed_by_requirements():
    local = {path.stem for path in tracked_files("*.py")}
    third_party = {name: where for name, where in imported_top_level_modules().items()
                   if name not in sys.stdlib_module_names and name not in local and name not in OPTIONAL}
    assert {"torch", "transformers", "datasets", "pytest"} <= set(third_party), "the scan found too little"
    missing = []
    for name, where in sorted(third_party.items()):
        try:
            importlib.import_module(name)
        except ImportError as error:
            missing.append(f"{name} (imported by {where}: {error})")
    assert not missing, f"requirements.txt does not install: {missing}"
