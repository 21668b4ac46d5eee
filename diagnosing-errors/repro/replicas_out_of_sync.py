"""The loss on 2 ranks differs from 1: replicas that must agree differ, batches that must differ agree.

    torchrun --nproc_per_node=2 repro/replicas_out_of_sync.py            # both bugs, and the checks that see it
    torchrun --nproc_per_node=2 repro/replicas_out_of_sync.py --fixed    # the same losses as one process:
    torchrun --nproc_per_node=1 repro/replicas_out_of_sync.py --fixed

Data parallelism is right only while every rank holds the same weights and reads different samples. Two bugs
break that without an error:
- the seed is set per rank before the model is built, so each replica starts from other weights. DDP hides
  this one (its constructor copies rank 0's weights to all); FSDP, a hand-written all-reduce, or a layer built
  after the wrapper does not.
- no DistributedSampler: every rank reads the whole data set in the same order, so a step trains on N copies
  of one batch, and an epoch takes N times as many samples as it should.
The checks (every step, a checksum gathered from every rank): weights must agree, batches must not.
"""
import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

GLOBAL_BATCH = 8


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fixed", action="store_true", help="one seed for all ranks, and a DistributedSampler")
    parser.add_argument("--timeout", type=float, default=30, help="process group timeout in seconds")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()

    # the data set is the same on every rank (its own generator, seed 0)
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(64, 8, generator=generator)
    targets = inputs @ torch.randn(8, 1, generator=generator) + 0.1 * torch.randn(64, 1, generator=generator)
    dataset = TensorDataset(torch.arange(64), inputs, targets)

    torch.manual_seed(0 if args.fixed else rank)  # BUG without --fixed: another initial model on every rank
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # BUG without --fixed: no sampler, so every rank reads every sample in the same order
    sampler = DistributedSampler(dataset, shuffle=False, drop_last=True) if args.fixed else None
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // world_size, sampler=sampler)

    reported = set()
    for step, (indices, x, y) in enumerate(loader):
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        check_across_ranks(step, "weights", weights, must_agree=True, reported=reported)
        check_across_ranks(step, "batches", indices, must_agree=False, reported=reported)
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        # NOTE: what DDP does after backward: average every gradient over the ranks.
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        optimizer.step()
        dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"step {step}: loss {loss.item():.6f}", flush=True)
    dist.destroy_process_group()


def check_across_ranks(step, name, tensor, must_agree, reported):
    """Gather a checksum of `tensor` from every rank; say so (once per name) when they break the rule."""
    if dist.get_world_size() == 1:
        return
    # NOTE: weighting each element by its position makes reordered elements change the checksum too.
    flat = tensor.detach().double().flatten()
    checksum = (flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum().reshape(1)
    checksums = [torch.zeros_like(checksum) for _ in range(dist.get_world_size())]
    dist.all_gather(checksums, checksum)
    values = [c.item() for c in checksums]
    agree = all(value == values[0] for value in values)
    if agree != must_agree and name not in reported and dist.get_rank() == 0:
        what = "differ across ranks" if must_agree else "are the same on every rank"
        print(f"step {step}: {name} {what}: checksums {[round(v, 4) for v in values]}", flush=True)
        reported.add(name)


if __name__ == "__main__":
    main()
    # NOTE: os._exit skips the interpreter's teardown, where gloo's leftover threads can abort a finished
    # process ("terminate called without an active exception", pytorch/pytorch#190489): see the README.
    sys.stdout.flush()
    os._exit(0)
