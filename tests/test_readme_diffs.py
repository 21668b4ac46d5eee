"""Each chapter README teaches its code in hunks of the diff against the previous chapter; these tests keep every
hunk it shows equal to the real diff, short enough to follow, and the command for the whole diff in view."""
import functools
import re

import pytest

from conftest import tracked_files
from readme_diffs import ROOT, chapter_diff, diff_blocks, readmes

READMES = readmes()
BLOCKS = [(readme, *block) for readme in READMES for block in diff_blocks(readme)]
# A hunk a reader reads in one go, with the prose around it; the whole diff is one command away.
LONGEST_BLOCK = 150


@pytest.mark.parametrize(
    "readme,old,new,name,first,last,anchor,shown", BLOCKS,
    ids=[f"{r.parent.name}:{n or 'file'}:{a or f or ''}" for r, _, _, n, f, _, a, _ in BLOCKS],
)
def test_readme_diff_matches_the_scripts(readme, old, new, name, first, last, anchor, shown):
    assert shown == chapter_diff(old, new, name, first, last, anchor), (
        f"{readme.relative_to(ROOT)} shows an outdated diff of {new}; run `python tests/readme_diffs.py`"
    )
    assert shown.strip() and not shown.startswith("("), shown
    assert len(shown.splitlines()) <= LONGEST_BLOCK, f"{readme.relative_to(ROOT)}: {len(shown.splitlines())} lines"


@pytest.mark.parametrize("readme", sorted({block[0] for block in BLOCKS}), ids=lambda r: r.parent.name)
def test_a_readme_that_shows_hunks_gives_the_command_for_the_whole_diff(readme):
    pairs = {(old, new) for old, new, *_ in diff_blocks(readme)}
    text = " ".join(readme.read_text().split())
    for old, new in pairs:
        assert re.search(rf"diff (\.\./)?{re.escape(old)} (\.\./)?{re.escape(new)}", text), (
            f"{readme.relative_to(ROOT)} shows hunks of {new} but not the command for the whole diff"
        )


@pytest.mark.parametrize("readme", sorted({block[0] for block in BLOCKS}), ids=lambda r: r.parent.name)
def test_no_two_blocks_of_a_readme_show_the_same_lines(readme):
    # (two anchors in hunks that a shorter change merged into one would show the reader the same lines twice)
    hunks = [(old, new, name, line) for old, new, name, *_, shown in diff_blocks(readme)
             for line in shown.splitlines() if line.startswith("@@")]
    repeated = sorted({hunk for hunk in hunks if hunks.count(hunk) > 1})
    assert not repeated, f"{readme.relative_to(ROOT)} shows these hunks twice: {repeated}"


# A python block a README takes from a file says so: <!-- quote path/to/file.py --> on the line before it.
PYTHON_BLOCK = re.compile(r"(?:<!-- quote (\S+) -->\n)?```python\n(.*?)```\n", re.DOTALL)
# The repository's own scripts and tools (git's list: not a virtual environment or outputs inside the clone).
SOURCES = [path for path in tracked_files("*.py") if path.parent.name != "tests"]
PYTHON_BLOCKS = [(readme, quoted, block) for readme in READMES for quoted, block in PYTHON_BLOCK.findall(
    readme.read_text())]


def is_excerpt(block, text):
    """Whether the block's lines are consecutive lines of text, all indented alike (a quote may be dedented)."""
    lines, file_lines = block.splitlines(), text.splitlines()
    for start, line in enumerate(file_lines):
        indent = line[: len(line) - len(lines[0])]
        if line.endswith(lines[0]) and not indent.strip():
            run = file_lines[start : start + len(lines)]
            if len(run) == len(lines) and all(
                    (theirs.strip() == "") if not ours else theirs == indent + ours for ours, theirs in zip(lines, run)):
                return True
    return False


@functools.cache
def lines_of_sources():
    return {line.strip() for path in SOURCES if path.exists() for line in path.read_text().splitlines()}


def share_of_lines_found_in_sources(block):
    """The share of the block's longer lines (12 characters or more: not `try:`) that some script or tool has."""
    lines = [line.strip() for line in block.splitlines() if len(line.strip()) >= 12]
    return sum(line in lines_of_sources() for line in lines) / max(1, len(lines))


@pytest.mark.parametrize("readme,quoted,block", PYTHON_BLOCKS,
                         ids=[f"{r.parent.name}:{b.splitlines()[0][:30]}" for r, _, b in PYTHON_BLOCKS])
def test_python_a_readme_quotes_is_the_current_text_of_the_file(readme, quoted, block):
    where = readme.relative_to(ROOT)
    if quoted:
        assert (ROOT / quoted).is_file(), f"{where} quotes {quoted}, which does not exist"
        assert is_excerpt(block, (ROOT / quoted).read_text()), (
            f"{where} quotes lines that {quoted} does not have (any more): copy them from the file again"
        )
    else:
        # A sketch of code that is in no file is fine; a copy of a script's lines must be marked, to be checked.
        assert share_of_lines_found_in_sources(block) < 0.5, (
            f"{where} shows lines of a script without saying which: put <!-- quote path/to/file.py --> above it"
        )
