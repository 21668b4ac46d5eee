"""One rank is slower than the others: every step waits for it, and nothing fails.

    torchrun --nproc_per_node=2 repro/straggler.py                 # rank 1 works 0.2 s longer every step
    torchrun --nproc_per_node=2 repro/straggler.py --steps 1000    # long enough to watch with tools/monitor.py

A step is work (here a CPU-bound loop; on GPUs, forward and backward) and then an all_reduce. A collective ends
only when the last rank has joined it, so the fast ranks spend the straggler's extra time waiting inside the
all_reduce, and the whole job runs at the straggler's speed. Timing both parts on every rank and gathering the
times names it: the straggler has the longest work and the shortest wait.
"""
import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--delay", type=float, default=0.2, help="the slow rank's extra seconds of work a step")
    parser.add_argument("--timeout", type=float, default=30, help="process group timeout in seconds")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()

    matrix = torch.randn(64, 64)
    for step in range(args.steps):
        started = time.perf_counter()
        work_until = started + 0.05 + (args.delay if rank == args.slow_rank else 0)
        while time.perf_counter() < work_until:
            matrix = torch.tanh(matrix @ matrix)
        worked = time.perf_counter()
        dist.all_reduce(matrix)
        waited = time.perf_counter()
        # NOTE: one small all_gather of (work, wait) a step; a real job would do this every N steps.
        times = torch.tensor([worked - started, waited - worked])
        all_times = [torch.zeros(2) for _ in range(world_size)]
        dist.all_gather(all_times, times)
        if rank == 0:
            work = [round(t[0].item(), 2) for t in all_times]
            wait = [round(t[1].item(), 2) for t in all_times]
            slowest = max(range(world_size), key=lambda r: work[r])
            print(f"step {step}: {waited - started:.2f} s; work by rank {work} s, wait in all_reduce {wait} s; "
                  f"slowest: rank {slowest}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # NOTE: os._exit skips the interpreter's teardown, where gloo's leftover threads can abort a finished
    # process ("terminate called without an active exception", pytorch/pytorch#190489): see the README.
    sys.stdout.flush()
    os._exit(0)
