"""A hang or a failure far from the cause: a V-shaped pipeline schedule over stages placed in a loop.

    torchrun --nproc_per_node=2 repro/v_schedule_on_a_loop.py            # rank r holds stages r and r+2
    torchrun --nproc_per_node=2 repro/v_schedule_on_a_loop.py --fixed    # rank r holds stages r and 3-r

ScheduleZBVZeroBubble (and ScheduleDualPipeV) expect rank r to hold stages r and 2P-1-r, so that a micro-batch
goes down the ranks and back up, and they address each message to the rank where that V puts a stage, whatever
the ranks hold. Here rank 0 holds stages 0 and 2 and rank 1 stages 1 and 3 (the loop of the interleaved
schedules): messages go where no stage waits for them. Either each rank waits for one that never comes, until
the process group's timeout, or a rank takes a message meant for another stage as the shape of its input and
asks for some 140 TB; which of the two varies from run to run. Nothing compares the two placements, and the
traceback names only a recv or an allocation. The fix: place the stages as the schedule does (chapter 08's
stage_placement), or use a schedule that runs in a loop.
"""
import argparse
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fixed", action="store_true", help="place the stages in a V, as the schedule does")
    parser.add_argument("--timeout", type=float, default=30, help="process group timeout in seconds")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    num_stages = 2 * num_ranks
    # BUG (without --fixed): the interleaved schedules' loop, not the V this schedule runs
    indices = [rank, num_stages - 1 - rank] if args.fixed else [rank, rank + num_ranks]
    print(f"rank {rank}: stages {indices}", flush=True)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16) for _ in range(num_stages)]
    stages = [PipelineStage(layers[index], index, num_stages, torch.device("cpu")) for index in indices]
    schedule = ScheduleZBVZeroBubble(stages, n_microbatches=4, loss_fn=lambda out, target: out.pow(2).mean())
    losses = []
    # (rank 0 holds stage 0 in either placement: it takes the inputs; the last stage the targets)
    has_last_stage = num_stages - 1 in indices
    schedule.step(*([torch.ones(8, 16)] if 0 in indices else []), target=torch.zeros(8, 16) if has_last_stage
                  else None, losses=losses)
    if has_last_stage:
        print(f"rank {rank}: loss {torch.stack(losses).mean().item():.6f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
