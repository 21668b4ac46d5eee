"""Run a chapter script unchanged, plus one fault injected on one rank at a known step.

    FAULT_SCRIPT=02-distributed-data-parallel/train_llm.py FAULT=raise FAULT_RANK=1 FAULT_AFTER_STEP=2 \
        torchrun --nproc_per_node=2 tests/fault_injection.py <the script's flags>

FAULT=raise   the rank raises RuntimeError right after its optimizer step number FAULT_AFTER_STEP
FAULT=sigterm the rank sends itself a real SIGTERM at that moment (what Slurm or torchrun would send)

Steps are counted with torch's public global optimizer hook, so the chapter script is run as it is, as
__main__, under a real torchrun and a real process group. Not collected by pytest (no test_ prefix).
"""
import os
import runpy
import signal
import sys
import time

from torch.optim.optimizer import register_optimizer_step_post_hook


def main():
    script = os.path.abspath(os.environ["FAULT_SCRIPT"])
    fault = os.environ["FAULT"]
    fault_rank = int(os.environ.get("FAULT_RANK", "1"))
    fault_after_step = int(os.environ["FAULT_AFTER_STEP"])
    rank = int(os.environ.get("RANK", "0"))
    steps_done = 0

    def after_optimizer_step(optimizer, args, kwargs):
        nonlocal steps_done
        steps_done += 1
        if rank != fault_rank or steps_done != fault_after_step:
            return
        # NOTE: the wall-clock time lets a test measure how long the job takes to end after the fault.
        print(f"fault_injection: {fault} on rank {rank} after step {steps_done} at {time.time():.3f}",
              file=sys.stderr, flush=True)
        if fault == "raise":
            raise RuntimeError(f"injected failure on rank {rank} after step {steps_done}")
        if fault == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            raise ValueError(f"unknown FAULT={fault!r}; use raise or sigterm")

    register_optimizer_step_post_hook(after_optimizer_step)
    sys.argv[0] = script
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
