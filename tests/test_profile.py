"""--profile, in every chapter: torch.profiler traces steps 3 and 4 of a launch into one Chrome trace per rank,
in which the chapter's collectives and its compute are visible; the run trains exactly as without the flag."""
import json

import pytest

from conftest import CHAPTERS, INJECT, inject_env
from launching import load_script

STEPS = ["--max-steps", 5]
# chapter: (processes, flags, events every rank's trace must hold: its collectives and a matmul)
CHAPTER_EVENTS = {
    "01": (None, ["-b", 8], {"aten::mm"}),
    # DDP all-reduces the gradient buckets during backward
    "02": (2, ["-b", 4], {"gloo:all_reduce", "aten::mm"}),
    # FSDP all-gathers each block's weights before it runs (gloo reduces gradients with all_reduce)
    "04": (2, ["-b", 4], {"gloo:all_gather", "FSDP::all_gather (model.layers.0)", "gloo:all_reduce", "aten::mm"}),
}


@pytest.mark.parametrize("chapter", CHAPTER_EVENTS)
def test_profile_traces_steps_3_and_4_on_every_rank_with_its_collectives(chapter, launch_once, common_args):
    nproc, flags, expected = CHAPTER_EVENTS[chapter]
    run = launch_once(chapter, [*common_args, *flags, *STEPS, "--profile"], nproc=nproc)
    for rank in range(nproc or 1):
        trace = run.exp_dir / "profile" / f"rank-{rank}.json"
        assert f"rank {rank}: steps 3-4 profiled" in run.stdout and str(trace) in run.stdout
        names = {event["name"] for event in json.loads(trace.read_text())["traceEvents"] if event.get("ph") == "X"}
        assert expected <= names, expected - names
        # the profiler counts steps from 0: its steps 2 and 3 are the launch's third and fourth
        assert sorted(name for name in names if name.startswith("ProfilerStep#")) == ["ProfilerStep#2",
                                                                                     "ProfilerStep#3"]
    unprofiled = launch_once(chapter, [*common_args, *flags, *STEPS], nproc=nproc)
    assert run.losses == unprofiled.losses
    assert not (unprofiled.exp_dir / "profile").exists()


@pytest.mark.parametrize("chapter", [chapter for chapter, folder in CHAPTERS.items()
                                     if (folder / "train_llm.py").exists()])
def test_every_chapter_takes_the_profile_flag(chapter):
    script = load_script(CHAPTERS[chapter] / "train_llm.py")
    assert script["get_parser"]().parse_args(["--profile"]).profile
    assert not script["get_parser"]().parse_args([]).profile


def test_a_launch_too_short_to_profile_says_so_and_trains_as_without_the_flag(launch_once, common_args):
    run = launch_once("01", [*common_args, "-b", 8, "--max-steps", 3, "--profile"])
    assert ("warning: --profile records steps 3-4 of this launch, which ends at step 3: nothing is profiled; "
            "launch with 4 or more steps to go") in run.stdout
    assert not (run.exp_dir / "profile").exists()
    assert run.losses == launch_once("01", [*common_args, "-b", 8, *STEPS]).losses[:3]


def test_a_launch_stopped_before_step_4_says_nothing_was_profiled(launch_once, common_args):
    """A SIGTERM after step 3 ends the launch inside the recorded steps: no half trace, and a line that says so."""
    run = launch_once("01", [*common_args, "-b", 8, *STEPS, "--profile"], script=INJECT, expect_ok=False,
                      env=inject_env("01", "sigterm", after_step=3))
    assert run.returncode == 1, run.stderr[-2000:]
    assert "rank 0: the launch stopped before the end of steps 3-4: nothing profiled" in run.stdout
    assert not (run.exp_dir / "profile").exists()
