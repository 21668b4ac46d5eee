"""A NaN loss: find the first bad step, the rank that produced it, and its samples.

    torchrun --nproc_per_node=2 repro/nan_loss.py                    # every rank logs nan from step 2 on
    torchrun --nproc_per_node=2 repro/nan_loss.py --check            # stops at step 2, names rank 1, sample 21
    torchrun --nproc_per_node=2 repro/nan_loss.py --detect-anomaly   # names the operation whose gradient is nan

Sample 21 is corrupt (a feature normalised by a standard deviation of 0: 0/0 = nan). Rank 1 reads it at
step 2 and its loss is nan; the all_reduce of the gradients then carries the nan into every rank's weights,
and from step 3 on every rank's loss is nan: the log no longer says where it started. --check gathers every
rank's loss before backward, so all ranks see a bad one at the same step, say whose and which samples, and
stop together before the optimizer step spreads it.
"""
import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

BATCH = 4
STEPS = 6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="stop at the first non-finite loss on any rank")
    parser.add_argument("--detect-anomaly", action="store_true", help="torch.autograd.set_detect_anomaly(True)")
    parser.add_argument("--timeout", type=float, default=30, help="process group timeout in seconds")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # NOTE: anomaly mode checks every backward operation's output for nan: slow, for debugging only.
    torch.autograd.set_detect_anomaly(args.detect_anomaly)

    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(64, 8, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True)
    inputs[21, 3] = float("nan")  # the corrupt sample
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    for step in range(STEPS):
        # rank r reads samples r, r + world_size, ... (what DistributedSampler gives without shuffling)
        indices = torch.arange(rank, 64, world_size)[step * BATCH:(step + 1) * BATCH]
        loss = F.mse_loss(model(inputs[indices]), targets[indices])
        if args.check and not all_finite(step, loss, indices, inputs):
            break
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        optimizer.step()
        dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


def all_finite(step, loss, indices, inputs):
    """True when every rank's loss is finite; otherwise print who and what went wrong (on every rank alike)."""
    losses = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(losses, loss.detach().reshape(1))
    bad_ranks = [r for r, value in enumerate(losses) if not torch.isfinite(value).all()]
    if not bad_ranks:
        return True
    if dist.get_rank() == 0:
        by_rank = [round(value.item(), 4) for value in losses]
        print(f"step {step}: first non-finite loss, on rank {', '.join(map(str, bad_ranks))} (losses by rank "
              f"{by_rank}); stopping before the optimizer step", flush=True)
    if dist.get_rank() in bad_ranks:
        bad_samples = indices[~torch.isfinite(inputs[indices]).all(dim=1)].tolist()
        print(f"rank {dist.get_rank()}: samples {bad_samples} of its batch {indices.tolist()} hold nan or inf",
              flush=True)
    return False


if __name__ == "__main__":
    main()
    # NOTE: os._exit skips the interpreter's teardown, where gloo's leftover threads can abort a finished
    # process ("terminate called without an active exception", pytorch/pytorch#190489): see the README.
    sys.stdout.flush()
    os._exit(0)
