"""The READMEs say only what is true: every relative link resolves, and every command they show runs.

Commands: each line of a ```bash block that starts with `python ` or `torchrun ` (after optional `VAR=value`
prefixes; in `a && b`, each part counts as a line) runs from its README's folder, offline, with
` --max-steps 2 --save-dir <tmp>` appended if its script takes them (a command's own --max-steps of at most 5
kept), and must exit 0;
every `warning:` line it prints must stand in its README. A block whose last non-blank line before the fence
is `<!-- needs: <reason> -->` is skipped with that reason (GPUs, the Hub, a cluster). The test command
(`python -m pytest ...`) is the one exception: running the suite inside the suite would recurse, so instead it
must be exactly what CI runs (.ci/run).

A command is not run twice in one session. These tests run last (conftest.py), and when an earlier test (of
a chapter, a related topic, or this one for another README) ran the command's script on as many processes with
the same flags as the command, no more and no fewer (its -e, --save-dir and --max-steps aside), and exited 0,
the command is skipped with that test's name: a second launch would repeat 5-20 s of imports and prove nothing
new. `pytest tests/test_docs.py` alone runs every command.
"""
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

import launching
from conftest import ROOT, Launch, offline_env, record_launch, successful_launches, tracked_files
from launching import load_script

# related-topics/ holds a README per topic, one level further down.
READMES = [ROOT / "README.md", *sorted(r for pattern in ("*/README.md", "related-topics/*/README.md")
                                        for r in ROOT.glob(pattern) if not r.parent.name.startswith("."))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
NEEDS = re.compile(r"<!--\s*needs\b:?(.*?)-->")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
COMMAND = re.compile(r"^(?:\w+=\S*\s+)*(?:python|torchrun)\s")
TEST_COMMAND = re.compile(r"^python -m pytest\b")


def name(readme):
    return str(readme.relative_to(ROOT))


def bash_blocks(readme):
    """(the `needs` reason or None, the block's text) for each ```bash block."""
    text = readme.read_text()
    blocks = []
    for fence in FENCE.finditer(text):
        if fence[1] != "bash":
            continue
        before = text[: fence.start()].rstrip().splitlines()
        needs = NEEDS.fullmatch(before[-1].strip()) if before else None
        blocks.append((needs[1].strip() if needs else None, fence[2]))
    return blocks


def commands(block):
    """The python/torchrun commands of a bash block: continuations joined, `&&` split, comments dropped."""
    found = []
    for line in block.replace("\\\n", " ").splitlines():
        for part in line.split("&&"):
            part = re.sub(r"\s+#.*$", "", part.strip())
            if COMMAND.match(part):
                found.append(part)
    return found


RUNNABLE = [
    pytest.param(readme, command, needs, id=f"{name(readme)}: {command}")
    for readme in READMES
    for needs, block in bash_blocks(readme)
    for command in commands(block)
    if not TEST_COMMAND.match(command)
]
TEST_COMMANDS = [command for needs, block in bash_blocks(ROOT / "README.md") for command in commands(block)
                 if TEST_COMMAND.match(command)]


@pytest.mark.parametrize("readme", READMES, ids=name)
def test_relative_links_resolve(readme):
    text = FENCE.sub("", readme.read_text())
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (readme.parent / path).resolve() if path else readme
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in heading_anchors(file):
            broken.append(target)
    assert not broken, f"{name(readme)} links to what does not exist: {broken}"


def heading_anchors(markdown_file):
    """GitHub's anchors: headings lowercased, punctuation dropped, spaces turned into hyphens."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", FENCE.sub("", markdown_file.read_text()), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_top_readme_links_every_chapter_folder():
    chapters = [d.name for d in ROOT.iterdir() if d.is_dir() and re.match(r"\d\d-", d.name)]
    unlinked = [chapter for chapter in chapters if f"]({chapter}/)" not in (ROOT / "README.md").read_text()]
    assert not unlinked, f"README.md's chapter table does not link {unlinked} (still marked planned?)"


MARKDOWN_FILES = tracked_files("*.md")


@pytest.mark.parametrize("markdown", MARKDOWN_FILES, ids=name)
def test_every_code_fence_closes(markdown):
    """A fence closes only on a line of backticks alone (CommonMark): "``` More text" leaves the block open, and
    the page renders as code down to the next fence."""
    opened_at = None
    for number, line in enumerate(markdown.read_text().splitlines(), 1):
        fence = re.match(r"^\s{0,3}(`{3,})(.*)$", line)
        if fence is None:
            continue
        if opened_at is None:
            opened_at = number
        else:
            assert not fence[2].strip(), (
                f"{name(markdown)}:{number}: text after a closing fence keeps the block of line {opened_at} open; "
                "put the fence on a line of its own"
            )
            opened_at = None
    assert opened_at is None, f"{name(markdown)}: the code block opened at line {opened_at} never closes"


@pytest.mark.parametrize("readme", READMES, ids=name)
def test_every_needs_marker_gives_a_reason(readme):
    markers = NEEDS.findall(readme.read_text())
    assert all(reason.strip() for reason in markers), (
        f"{name(readme)} has a `<!-- needs -->` marker without a reason; write `<!-- needs: what it needs -->`"
    )


@pytest.mark.parametrize("readme,command,needs", RUNNABLE)
def test_readme_command_runs(readme, command, needs, tmp_path):
    if needs is not None:
        assert needs, f"the `<!-- needs -->` marker before `{command}` in {name(readme)} gives no reason"
        pytest.skip(f"needs {needs}")
    ran_by = earlier_launch(readme, command)
    if ran_by is not None:
        pytest.skip(f"{ran_by} ran this script on these processes with these flags")
    env = offline_env(tmp_path)
    # NOTE: `python` and `torchrun` must be this environment's, as they are for a reader with the venv active.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    # A command's own --max-steps runs when it is short (--profile needs 4 steps); else 2 steps prove it runs.
    own_steps = re.search(r"--max-steps[ =](\d+)", command)
    steps = int(own_steps[1]) if own_steps and int(own_steps[1]) <= 5 else 2
    full_command = f"{command} --max-steps {steps} --save-dir {tmp_path / 'outputs'}"
    if not takes_training_flags(readme, command):
        full_command = command
    # (through bash, as a reader's shell runs it: `&&`, `VAR=value` prefixes)
    process = launching.start(["bash", "-c", full_command], readme.parent, env)
    stdout, stderr, how = launching.wait(process, 300)
    if how == "timed out":
        pytest.fail(f"`{full_command}` in {name(readme)} hung for 300 s\n{stdout[-3000:]}\n{stderr[-3000:]}")
    assert process.returncode == 0, (
        f"`{full_command}` in {name(readme)} exited {process.returncode}\n--- stdout\n{stdout[-3000:]}"
        f"\n--- stderr\n{stderr[-5000:]}"
    )
    shortened = own_steps is None or int(own_steps[1]) != steps
    unexplained = [line for line in (stdout + stderr).splitlines() if line.startswith("warning: ")
                   and line[:60] not in readme.read_text()
                   # 2 steps make most of any warmup: the test's --max-steps, not the reader's command
                   and not (shortened and line.startswith("warning: --warmup-steps"))]
    assert not unexplained, f"`{command}` in {name(readme)} prints warnings its README does not show: " \
                            f"{unexplained}"
    launch = as_launch(readme, command)
    if launch is not None:
        record_launch(launch.script, launch.nproc, launch.args)


OUTPUT_FLAG = re.compile(r"(?:^|\s)(?:-o|--output|--out|--plot)[ =]([^\s`]+)")


@pytest.mark.parametrize("readme", READMES, ids=name)
def test_no_readme_command_writes_over_a_committed_file(readme):
    tracked = set(tracked_files("*"))
    overwritten = [path for path in OUTPUT_FLAG.findall(readme.read_text())
                   if (readme.parent / path).resolve() in tracked]
    assert not overwritten, f"{name(readme)}: commands write over committed files {overwritten}; write them " \
                            "under outputs/"


@pytest.mark.parametrize("readme", READMES, ids=name)
def test_commands_that_train_different_runs_name_different_experiments(readme):
    """Two commands under one -e are one run: the second resumes the first's checkpoint, so a reader's next
    command with other flags would stop ("the run has finished", "a different model") or continue the wrong
    run. Only a relaunch (the same command, perhaps with another --max-steps) shares an -e."""
    runs, collisions = {}, []
    for _, block in bash_blocks(readme):
        for command in commands(block):
            launch = as_launch(readme, command)
            script = Path(launch.script) if launch is not None else None
            if script is None or "--experiment-name" not in (script.read_text() if script.is_file() else ""):
                continue
            experiment, what, words = "default", [launch.nproc], [str(arg) for arg in launch.args]
            while words:
                word = words.pop(0)
                if word in ("-e", "--experiment-name"):
                    experiment = words.pop(0)
                elif word == "--max-steps":  # a relaunch may train on
                    words.pop(0)
                else:
                    what.append(word)
            if runs.setdefault((launch.script, experiment), (what, command))[0] != what:
                collisions.append(f"`{runs[launch.script, experiment][1]}` and `{command}`")
    assert not collisions, f"{name(readme)}: these train different runs under one -e; give each its own: " \
                           f"{collisions}"


# The flags that say where a run writes and how long it runs, not what it trains.
NOT_COMPARED = {"experiment_name", "save_dir", "max_steps"}


def takes_training_flags(readme, command):
    """Whether the command's script takes --max-steps and --save-dir (a training script; chapter 12's planner
    does not train)."""
    script = next((word for word in shlex.split(command) if word.endswith(".py")), None)
    path = readme.parent / script if script else None
    return path is None or not path.is_file() or "--max-steps" in path.read_text()


def as_launch(readme, command):
    """The command as a Launch (`python script flags` or `torchrun --nproc_per_node=N script flags`, after any
    `VAR=value` that the tests' environment has too), or None for any other form, which always runs."""
    words = shlex.split(command)
    test_environment = offline_env(readme.parent)
    while re.fullmatch(r"\w+=\S*", words[0]):
        variable, _, value = words.pop(0).partition("=")
        if test_environment.get(variable) != value:
            return None
    if words[0] == "python" and len(words) > 1:
        nproc, rest = None, words[1:]
    elif words[0] == "torchrun" and len(words) > 2 and re.fullmatch(r"--nproc_per_node=\d+", words[1]):
        nproc, rest = int(words[1].split("=")[1]), words[2:]
    else:
        return None
    script = str((readme.parent / rest[0]).resolve())
    return Launch(script, nproc, rest[1:], f"tests/test_docs.py ({name(readme)})")


def earlier_launch(readme, command):
    """The test whose successful launch in this session already ran the command (see the module docstring)."""
    wanted = as_launch(readme, command)
    if wanted is None:
        return None
    earlier = [launch for launch in successful_launches()
               if launch.script == wanted.script and launch.nproc == wanted.nproc]
    get_parser = load_script(wanted.script).get("get_parser") if earlier else None
    if get_parser is None:  # without a parser to read its flags, the command runs
        return None
    parser = get_parser()

    def parsed(args):
        try:
            return vars(parser.parse_args(args))
        except SystemExit:  # bad flags: a command with them fails when it runs
            return None

    def compared(args):
        flags = parsed(args)
        return None if flags is None else {key: value for key, value in flags.items() if key not in NOT_COMPARED}

    wanted_flags = compared(wanted.args)
    if wanted_flags is None:
        return None
    # NOTE: every flag equal, not "the command's flags and more": a test's launch with -m, -d or --dtype of its
    # own is not the command a reader types.
    return next((launch.test for launch in earlier if compared(launch.args) == wanted_flags), None)


def test_readme_test_command_is_what_ci_runs():
    assert len(TEST_COMMANDS) == 1, f"README.md should show one test command, found {TEST_COMMANDS}"
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert TEST_COMMANDS[0] in ci_lines, f".ci/run does not run the README's test command `{TEST_COMMANDS[0]}`"


def test_every_test_the_claims_table_names_exists():
    """The top README's table of claims names the tests that assert each one: a renamed or deleted test must
    not leave a claim that names nothing."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| claim | tests |"):].split("\n\n")[0]
    named = set(re.findall(r"`(test_\w+)`", table))
    defined = {name for path in (ROOT / "tests").glob("test_*.py")
               for name in re.findall(r"^def (test_\w+)\(", path.read_text(), re.MULTILINE)}
    assert len(named) > 50 and named <= defined, sorted(named - defined)
