"""Keep the diffs that chapter READMEs show equal to the real diff between chapter scripts.

A README marks a diff with a comment naming the two files (relative to the repository root), and optionally
one top-level function (or class) of them and which hunks of its diff to show, followed by a ```diff block:

    <!-- diff 02-distributed-data-parallel/train_llm.py 04-fully-sharded-data-parallel/train_llm.py -->
    <!-- diff 02-distributed-data-parallel/train_llm.py 04-fully-sharded-data-parallel/train_llm.py shard_model -->
    <!-- diff 02-distributed-data-parallel/train_llm.py 04-fully-sharded-data-parallel/train_llm.py main 2-3 -->
    <!-- diff 01-single-gpu/train_llm.py 02-distributed-data-parallel/train_llm.py main "no_sync" -->
    <!-- diff 02-distributed-data-parallel/train_llm.py 08-pipeline-parallel/train_llm.py SCHEDULES -->

The first shows the whole diff, the second the diff of shard_model alone (all `+` lines: it is new in 04),
the third hunks 2 and 3 of the diff of main, the fourth the one hunk of main's diff whose changed lines hold
that text (it stays the same hunk when others come or go), the fifth a top-level assignment (without the
comment above it). Hunks are unified-diff hunks with 3 lines of
context.

`python tests/readme_diffs.py [README ...]` rewrites every such block from the files; tests/test_readme_diffs.py fails
when a block and the files disagree, and when a block is longer than a reader can follow.
"""
import ast
import difflib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(
    r'<!-- diff (\S+) (\S+)(?: (\w+)(?: (\d+)(?:-(\d+))?| "([^"]+)")?)? -->\n```diff\n(.*?)```\n', re.DOTALL
)


def top_level(path, name):
    """The lines of a top-level function or class (with its decorators) or of an assignment to that name, []
    if the file has none by that name."""
    text = (ROOT / path).read_text()
    lines = text.splitlines(keepends=True)
    for node in ast.parse(text).body:
        targets = [target.id for target in getattr(node, "targets", []) if isinstance(target, ast.Name)]
        if name in (getattr(node, "name", None), *targets):
            decorators = getattr(node, "decorator_list", [])
            start = (decorators[0].lineno if decorators else node.lineno) - 1
            return lines[start : node.end_lineno]
    return []


def chapter_diff(old, new, name=None, first=None, last=None, anchor=None):
    """The unified diff of two files, or of one top-level function of them, or of some hunks of that: hunks
    first to last, or the one hunk whose changed lines hold the text `anchor`."""
    if name is None:
        old_lines, new_lines = ((ROOT / path).read_text().splitlines(keepends=True) for path in (old, new))
    else:
        old_lines, new_lines = top_level(old, name), top_level(new, name)
    diff = list(difflib.unified_diff(old_lines, new_lines, fromfile=old, tofile=new))
    hunk_starts = [index for index, line in enumerate(diff) if line.startswith("@@")]
    if anchor is not None:
        ends = [*hunk_starts[1:], len(diff)]
        holding = [number for number, (start, end) in enumerate(zip(hunk_starts, ends), 1)
                   if any(line[:1] in "+-" and anchor in line for line in diff[start + 1 : end])]
        if len(holding) != 1:
            return f"(the diff of {name} has {len(holding)} hunks whose changed lines hold {anchor!r}, not 1)\n"
        first = holding[0]
    if first is None:
        return "".join(diff)
    last = first if last is None else last
    if not 1 <= first <= last <= len(hunk_starts):
        return f"(no hunks {first}-{last}: the diff of {name} has {len(hunk_starts)})\n"
    end = hunk_starts[last] if last < len(hunk_starts) else len(diff)
    return "".join(diff[:2] + diff[hunk_starts[first - 1] : end])


def readmes():
    """Chapter READMEs, and related-topics/' one README per topic."""
    return sorted([*ROOT.glob("*/README.md"), *ROOT.glob("related-topics/*/README.md")])


def diff_blocks(readme):
    """(old file, new file, function or None, first hunk, last hunk, anchor text, block text) per block."""
    blocks = []
    for old, new, name, first, last, anchor, shown in MARKER.findall(readme.read_text()):
        blocks.append((old, new, name or None, int(first) if first else None, int(last) if last else None,
                       anchor or None, shown))
    return blocks


def rewrite(readme):
    text = readme.read_text()

    def block(match):
        old, new, name, first, last, anchor = match[1], match[2], match[3], match[4], match[5], match[6]
        shown = chapter_diff(old, new, name, int(first) if first else None, int(last) if last else None, anchor)
        marker = match[0].split("\n", 1)[0]
        return f"{marker}\n```diff\n{shown}```\n"

    updated = MARKER.sub(block, text)
    if updated != text:
        readme.write_text(updated)
        print(f"updated {readme.relative_to(ROOT)}")


if __name__ == "__main__":
    # (with paths: only those READMEs)
    for readme in [Path(arg).resolve() for arg in sys.argv[1:]] or readmes():
        rewrite(readme)
