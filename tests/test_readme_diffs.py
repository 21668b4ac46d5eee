"""Each chapter README shows the diff against the previous chapter; these tests keep it true."""
from pathlib import Path

import pytest

from readme_diffs import ROOT, chapter_diff, diff_blocks, readmes

READMES = readmes()
BLOCKS = [(readme, *block) for readme in READMES for block in diff_blocks(readme)]


@pytest.mark.parametrize(
    "readme,old,new,shown", BLOCKS, ids=[f"{r.parent.name}:{Path(n).parent}" for r, _, n, _ in BLOCKS]
)
def test_readme_diff_matches_the_scripts(readme, old, new, shown):
    assert shown == chapter_diff(old, new), (
        f"{readme.relative_to(ROOT)} shows an outdated diff of {new}; run `python tests/readme_diffs.py`"
    )
