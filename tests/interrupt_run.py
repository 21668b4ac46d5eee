"""Run a chapter's train_llm.py unchanged, and interrupt it the way a cluster does.

    TRAIN_SCRIPT=<path to train_llm.py> python tests/interrupt_run.py [its flags...]

with one of these in the environment too:
    SIGTERM_AFTER_STEP=k    send this process SIGTERM right after the k-th optimizer step of this launch
                            (what Slurm does before a time limit or preemption)
    SIGKILL_DURING_SAVE=n   in the n-th torch.save of this launch, write half of the file, then SIGKILL this
                            process (a node dying mid-checkpoint: no handler, no cleanup)

The script itself has no test hooks: the signal is real, the save is real (torch.save's own bytes, cut short),
and the script runs as __main__ exactly as `python train_llm.py` would run it.
"""
import io
import os
import runpy
import signal
import sys

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

script = os.environ["TRAIN_SCRIPT"]
sigterm_after_step = int(os.environ.get("SIGTERM_AFTER_STEP", 0))
sigkill_during_save = int(os.environ.get("SIGKILL_DURING_SAVE", 0))

if sigterm_after_step:
    steps_done = 0

    def send_sigterm_after_step(optimizer, args, kwargs):
        global steps_done
        steps_done += 1
        if steps_done == sigterm_after_step:
            os.kill(os.getpid(), signal.SIGTERM)

    register_optimizer_step_post_hook(send_sigterm_after_step)

if sigkill_during_save:
    real_save = torch.save
    saves_done = 0

    def save_then_die_halfway(obj, f, *args, **kwargs):
        global saves_done
        saves_done += 1
        if saves_done < sigkill_during_save:
            return real_save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        with open(f, "wb") as out:
            out.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            out.flush()
            os.fsync(out.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = save_then_die_halfway

sys.argv = [script, *sys.argv[1:]]
sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python train_llm.py` would set it
runpy.run_path(script, run_name="__main__")
