"""Run a chapter's train_llm.py unchanged under torchrun, plus one event (for tests/test_related_elastic.py).

    ELASTIC_SCRIPT=<path to train_llm.py> ELASTIC_EVENT=<what> [ELASTIC_RANK=r] [ELASTIC_AFTER_STEP=k] \
        torchrun ... tests/related_elastic_inject.py <the script's flags>

ELASTIC_EVENT=sigkill     rank r (default 1) sends itself SIGKILL right after its k-th optimizer step, in the
                          first start of the workers only (TORCHELASTIC_RESTART_COUNT=0): a crash (the OOM
                          killer, a segfault) that torchrun --max-restarts restarts, and that does not recur
ELASTIC_EVENT=slow-alone  while the job has one rank (WORLD_SIZE=1), sleep 1 s after each optimizer step from
                          the k-th on: the one-node run cannot end before a second node the test starts joins

tests/inject.py cannot do these: its faults fire in every start of the workers, so a restarted worker would
fail again. Steps are counted with torch's public global optimizer hook; the script runs as __main__.
Not collected by pytest (no test_ prefix).
"""
import os
import runpy
import signal
import sys
import time

from torch.optim.optimizer import register_optimizer_step_post_hook

script = os.path.abspath(os.environ["ELASTIC_SCRIPT"])
event = os.environ["ELASTIC_EVENT"]
after_step = int(os.environ.get("ELASTIC_AFTER_STEP", "1"))
rank = os.environ["RANK"]
first_start = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
steps_done = 0


def after_optimizer_step(optimizer, args, kwargs):
    global steps_done
    steps_done += 1
    if steps_done < after_step:
        return
    victim = first_start and rank == os.environ.get("ELASTIC_RANK", "1")
    if event == "sigkill" and victim and steps_done == after_step:
        # One write with its newline, flushed: the test reads it; SIGKILL leaves no chance to flush later.
        sys.stderr.write(f"elastic: SIGKILL to rank {rank} after step {steps_done}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    if event == "slow-alone" and os.environ["WORLD_SIZE"] == "1":
        time.sleep(1)


if event not in ("sigkill", "slow-alone"):
    raise SystemExit(f"related_elastic_inject.py: unknown ELASTIC_EVENT={event!r}")
register_optimizer_step_post_hook(after_optimizer_step)
sys.argv = [script, *sys.argv[1:]]
sys.path[0] = os.path.dirname(script)  # as `python train_llm.py` would set it
runpy.run_path(script, run_name="__main__")
