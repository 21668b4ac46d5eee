"""One rank dies in the middle of a step; the others are left waiting for it.

    torchrun --nproc_per_node=2 repro/rank_crash.py             # rank 1 raises an exception at step 2
    torchrun --nproc_per_node=2 repro/rank_crash.py --kill      # rank 1 is SIGKILLed, as the OOM killer does

The other ranks see only that a peer is gone ("Connection closed by peer") or are stopped by torchrun; the
cause is on the rank that died. @record (below) writes that rank's exception to the file torchrun names in
TORCHELASTIC_ERROR_FILE, so torchrun's failure summary shows the real error under "Root Cause" instead of
"To enable traceback see ...". A killed process writes nothing: its exit code (-9) is all that is left.
"""
import argparse
import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=30, help="process group timeout in seconds")
    parser.add_argument("--kill", action="store_true", help="SIGKILL rank 1 instead of raising an exception")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank = dist.get_rank()

    for step in range(5):
        if rank == 1 and step == 2:
            if args.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"sample {step * 8 + 5} is corrupt: cannot decode its tokens")
        gradient = torch.ones(4)
        dist.all_reduce(gradient)
        print(f"rank {rank}: step {step} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
