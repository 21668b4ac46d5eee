"""A hang: one rank skips a collective that the other ranks wait in.

    torchrun --nproc_per_node=2 repro/collective_mismatch.py                   # hangs, then times out
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --nproc_per_node=2 repro/collective_mismatch.py   # names it

The data are split across ranks without dropping the remainder: 7 samples give rank 0 four batches and rank 1
three. Rank 1 leaves the loop and waits in the barrier before "saving"; rank 0 waits in the all_reduce of its
fourth step. Each waits for a collective the other never starts: nothing moves until the process group's
timeout (PyTorch's default: 30 minutes for gloo, 10 for nccl; --timeout here).

--watchdog N arms faulthandler: a rank whose step has not finished after N seconds prints its Python stack.
"""
import argparse
import faulthandler
from datetime import timedelta

import torch
import torch.distributed as dist


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=30, help="process group timeout in seconds")
    parser.add_argument("--watchdog", type=float, default=0, help="print the stack of a step older than this")
    args = parser.parse_args()
    # NOTE: the timeout turns a silent hang into an exception raised in the collective that waits.
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()

    samples = list(range(7))
    my_samples = samples[rank::world_size]  # BUG: uneven shards; fix: drop the remainder (drop_last=True)
    for step, sample in enumerate(my_samples):
        if args.watchdog:
            # NOTE: re-armed every step: only a step that takes longer than --watchdog prints anything.
            faulthandler.dump_traceback_later(args.watchdog)
        gradient = torch.full((4,), float(sample))
        dist.all_reduce(gradient)
        print(f"rank {rank}: step {step} done", flush=True)
    print(f"rank {rank}: out of data after {len(my_samples)} steps; waiting for the others to save", flush=True)
    dist.barrier()
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
