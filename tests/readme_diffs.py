"""Keep the diffs that chapter READMEs show equal to the real diff between chapter scripts.

A README marks a diff with a comment naming the two files (relative to the repository root), followed by
a ```diff block:

    <!-- diff 01-single-gpu/train_llm.py 02-distributed-data-parallel/train_llm.py -->

`python tests/readme_diffs.py` rewrites every such block from the files; tests/test_readme_diffs.py fails
when a block and the files disagree.
"""
import difflib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!-- diff (\S+) (\S+) -->\n```diff\n(.*?)```\n", re.DOTALL)


def chapter_diff(old, new):
    old_lines = (ROOT / old).read_text().splitlines(keepends=True)
    new_lines = (ROOT / new).read_text().splitlines(keepends=True)
    return "".join(difflib.unified_diff(old_lines, new_lines, fromfile=old, tofile=new))


def readmes():
    """Chapter READMEs, and related-topics/' one README per topic."""
    return sorted([*ROOT.glob("*/README.md"), *ROOT.glob("related-topics/*/README.md")])


def diff_blocks(readme):
    """(old file, new file, block text in the README) for each marked diff."""
    return [match.groups() for match in MARKER.finditer(readme.read_text())]


def rewrite(readme):
    text = readme.read_text()
    updated = MARKER.sub(
        lambda m: f"<!-- diff {m[1]} {m[2]} -->\n```diff\n{chapter_diff(m[1], m[2])}```\n", text
    )
    if updated != text:
        readme.write_text(updated)
        print(f"updated {readme.relative_to(ROOT)}")


if __name__ == "__main__":
    for readme in readmes():
        rewrite(readme)
