"""Each chapter README teaches its code in hunks of the diff against the previous chapter; these tests keep every
hunk it shows equal to the real diff, short enough to follow, and the command for the whole diff in view."""
import re

import pytest

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
