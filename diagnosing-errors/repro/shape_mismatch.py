"""Wrong numbers, then a hang: ranks all_reduce tensors of different shapes.

    torchrun --nproc_per_node=2 repro/shape_mismatch.py
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --nproc_per_node=2 repro/shape_mismatch.py   # names the shapes

Each rank all_reduces its per-token losses to log their mean, and ranks hold different numbers of tokens
(rank 0 four, rank 1 three). A collective must have the same shape on every rank, and nothing checks that by
default: gloo pairs the buffers by position, so rank 1 returns a wrong sum at once while rank 0 waits for an
element that never comes. Nothing checks the shapes on NCCL either.
The fix: reduce a fixed shape, e.g. the pair (sum of losses, number of tokens), and divide afterwards.
"""
import argparse
from datetime import timedelta

import torch
import torch.distributed as dist


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=30, help="process group timeout in seconds")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank = dist.get_rank()

    per_token_loss = torch.ones(4 - rank)  # BUG: the shape depends on this rank's data
    print(f"rank {rank}: all_reduce of shape {list(per_token_loss.shape)}", flush=True)
    dist.all_reduce(per_token_loss)
    # NOTE: every element should now be 2.0 (1.0 from each of the 2 ranks).
    print(f"rank {rank}: got {per_token_loss.tolist()}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
