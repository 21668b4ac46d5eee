"""The one-command GPU check (tests/gpu_check.py): its CPU smoke mode builds the same table from real launches
of every chapter; on a machine with CUDA the full check runs and every row must pass."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gpu_check
import launching
from conftest import wait_or_fail

GPU_CHECK = Path(__file__).with_name("gpu_check.py")


def run_gpu_check(tmp_path, *flags, timeout, env=None):
    out = tmp_path / "gpu_check.md"
    process = launching.start([sys.executable, GPU_CHECK, "--out", out, *flags], tmp_path, env)
    [(returncode, stdout, stderr)] = wait_or_fail([process], timeout, "gpu_check.py")
    assert returncode == 0, f"exit {returncode}\n{stdout[-6000:]}\n{stderr[-2000:]}"
    return subprocess.CompletedProcess(process.args, returncode, stdout, stderr), out


def table_rows(markdown):
    """The table's rows as dicts keyed by its header (cells split at each | not escaped as \\|)."""

    def cells(line):
        return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]

    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    return [dict(zip(cells(lines[0]), cells(line))) for line in lines[2:]]


def test_cpu_smoke_mode_gives_a_passing_row_per_run_side_by_side_and_stopped_after_the_last_log(tmp_path):
    result, out = run_gpu_check(tmp_path, "--device", "cpu", "--quick", timeout=540)
    assert result.stderr.startswith("plan on CPU: about "), result.stderr[:500]
    rows = table_rows(out.read_text())
    assert [(row["chapter"], row["options"].split(", ")[-1]) for row in rows] == [
        *((chapter, "3 steps") for chapter in gpu_check.CHAPTERS), ("04", "3 steps --cpu-offload"),
        ("01", "until logged"), ("04", "until logged"),
    ]
    for row in rows:
        assert row["result"] == "pass", row
        assert float(row["tokens/s"].replace(",", "")) > 0, row
        assert float(row["peak memory GB"]) > 0, row
        assert row["MFU"] == "-", row  # NOTE: the chapters report MFU only on GPUs whose peak they know


@pytest.mark.parametrize("mode", ["full", "quick"])
@pytest.mark.parametrize("flash", [True, False])
def test_the_plan_fits_its_budget_with_margin_even_if_every_run_takes_its_whole_limit(mode, flash):
    stages = gpu_check.plan(mode == "quick", [], steps=20, flash=flash)
    budget = gpu_check.TOTAL_BUDGET_S[mode]
    estimate = sum(stage.total(stage.estimate_s) for stage in stages)
    limit = sum(stage.total(stage.limit_s) for stage in stages)
    # NOTE: limits that add up to the budget mean no run is starved by another's overrun; a quarter of the
    # budget left by the estimates, and a third more than its estimate for each stage, is the margin.
    assert limit <= budget, (limit, budget)
    assert estimate <= 0.75 * budget, (estimate, budget)
    assert all(stage.limit_s >= 1.3 * stage.estimate_s for stage in stages)
    described = gpu_check.describe_plan(stages, budget, "H200")
    assert described.startswith(f"plan on H200: about {estimate} s, at most {limit} s of the {budget} s budget")
    if mode == "full":
        runs = [run for stage in stages for run in stage.runs if not run.skipped]
        assert {run.chapter for run in runs if run.options == "defaults (no flags)"} == set(gpu_check.CHAPTERS)
        assert {run.chapter for run in runs if run.options == "--compile"} == set(gpu_check.CHAPTERS)
        # The 1B runs stop after their last logged step: a 15 GB checkpoint and a 5 GB export are not measured.
        assert all(run.until_last_log for run in runs if run.options.startswith("1B"))
        assert any("flash_attention_2" in run.options for run in runs) == flash


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(tmp_path):
    result, out = run_gpu_check(tmp_path, timeout=60, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert len(result.stdout.splitlines()) == 1 and "CUDA GPU" in result.stdout
    assert not out.exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the full GPU check needs a CUDA GPU")
def test_every_chapter_passes_on_the_gpu(tmp_path):
    # NOTE: the check budgets itself at 10 minutes; a non-zero exit (any failed row) fails here with the table.
    _, out = run_gpu_check(tmp_path, timeout=660)
    rows = table_rows(out.read_text())
    assert len(rows) == sum(len(stage.runs) for stage in gpu_check.plan(False, [], steps=20, flash=False))
    assert all(row["result"] == "pass" or row["result"].startswith("skipped") for row in rows), rows
    assert all(float(row["tokens/s"].replace(",", "")) > 0 for row in rows if row["result"] == "pass")
