"""tests/stress_exit.py, the tool behind the README's claim that every multi-process chapter exits 0 after its
work under load: it launches a chapter again and again beside spinning processes and counts how each exits.
Two launches here (fifty take a quarter of an hour), so the tool itself is known to run and to count."""
import re
import sys
from pathlib import Path

import launching
from conftest import wait_or_fail

STRESS_EXIT = Path(__file__).with_name("stress_exit.py")


def test_stress_exit_launches_a_chapter_under_load_and_counts_clean_exits(tmp_path):
    command = [sys.executable, STRESS_EXIT, "--chapter", "04", "--nproc", 2, "--launches", 2, "--spinners", 1,
               "--timeout", 180]
    # (a hang kills the tool and every process it started, its spinners included)
    [(returncode, stdout, stderr)] = wait_or_fail([launching.start(command, tmp_path, None)], 480, "stress_exit.py")
    assert returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert re.findall(r"^launch (\d)/2: ok in [\d.]+ s$", stdout, re.MULTILINE) == ["1", "2"], stdout
    summary = stdout.strip().splitlines()[-1]
    assert re.match(r"04-fully-sharded-data-parallel/train_llm\.py, 2 ranks, 2 launches under 1 spinning "
                    r"processes: 0 failed \(\{'ok': 2\}\)", summary), summary
