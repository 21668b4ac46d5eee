"""related-topics/effective-batch-size-and-lr: the scaling rules give the values the README states, and the
sweep script trains chapter 01 at each batch size and learning rate and prints the table the README shows."""
import math
import re
import subprocess
import sys

import pytest

import launching
from conftest import ROOT, offline_env, wait_or_fail
from launching import load_script, read_metrics

FOLDER = ROOT / "related-topics" / "effective-batch-size-and-lr"
SWEEP = FOLDER / "sweep.py"


@pytest.fixture(scope="module")
def sweep():
    return load_script(SWEEP)


@pytest.mark.parametrize("batch_size,linear,sqrt",
                         [(8, 1e-3, 1e-3), (32, 4e-3, 2e-3), (128, 1.6e-2, 4e-3), (2, 2.5e-4, 5e-4)])
def test_linear_rule_scales_lr_with_the_batch_and_sqrt_rule_with_its_root(sweep, batch_size, linear, sqrt):
    scaled_lr = sweep["scaled_lr"]
    assert math.isclose(scaled_lr(1e-3, 8, batch_size, "linear"), linear)
    assert math.isclose(scaled_lr(1e-3, 8, batch_size, "sqrt"), sqrt)
    with pytest.raises(ValueError, match="unknown scaling rule"):
        scaled_lr(1e-3, 8, batch_size, "cubic")


def test_sweep_trains_chapter_01_at_each_batch_size_and_prints_the_table(tmp_path):
    command = [sys.executable, str(SWEEP), "--batch-sizes", "8", "32", "--lrs", "1e-3", "--max-steps", "2",
               "--save-dir", str(tmp_path / "sweep")]
    [(returncode, stdout, stderr)] = wait_or_fail([launching.start(command, tmp_path, offline_env(tmp_path))], 180,
                                                  "sweep.py")
    assert returncode == 0, stderr[-3000:]
    rows = re.findall(r"^\| (\d+) \| (\d+) \| \*\*([\d.]+)\*\* \| ([\de.-]+) \| ([\de.-]+) \| ([\de.-]+) \|$",
                      stdout, re.MULTILINE)
    # one row per batch size: its steps (cut to 2), the loss, the best lr, and what the rules derive from 1e-3
    assert [(b, steps) for b, steps, *_ in rows] == [("8", "2"), ("32", "2")], stdout
    assert [tuple(float(lr) for lr in row[3:]) for row in rows] == [(1e-3, 1e-3, 1e-3), (1e-3, 4e-3, 2e-3)]
    # each row's loss is the last metrics line of the chapter 01 run it launched with that batch size
    for batch_size, _, loss, *_ in rows:
        metrics = read_metrics(tmp_path / "sweep" / f"b{batch_size}-lr0.001-steps2" / "metrics.jsonl")
        assert abs(float(loss) - metrics[-1]["loss"]) < 1e-4


def test_sweep_rejects_a_batch_size_that_does_not_divide_the_token_budget(tmp_path):
    done = subprocess.run([sys.executable, str(SWEEP), "--batch-sizes", "48", "--save-dir", str(tmp_path)],
                          env=offline_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "error: --tokens 262144 is 2048 sequences of 128, which batch size 48 does not divide; "
        "use batch sizes that divide 2048"]
