"""One small DDP training loop, logged to Weights & Biases in the three ways multi-process jobs use.

    WANDB_MODE=offline torchrun --nproc_per_node=2 train_wandb_modes.py --wandb-mode rank0       # 1 run
    WANDB_MODE=offline torchrun --nproc_per_node=2 train_wandb_modes.py --wandb-mode every-rank  # 1 a rank
    torchrun --nnodes=2 --nproc_per_node=8 ... train_wandb_modes.py --wandb-mode per-node        # 1 a node

rank0 is what the chapters do: one run, the loss of the whole global batch. per-node: the first process of
each node logs to a run of its own (the node's system metrics: its GPUs, its memory, its network), all runs of
the job in one group. every-rank: each process logs its own run, in one group. A launch checkpoints at its
last step; relaunching the same -e with a larger --max-steps trains on from there and continues the same
run(s), whose ids are derived from -e.
"""
import argparse
import gc
import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel


def main():
    args = get_parser().parse_args()
    if "LOCAL_RANK" not in os.environ:
        sys.exit("error: launch this script with torchrun, e.g. "
                 "torchrun --nproc_per_node=2 train_wandb_modes.py")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    # torchrun numbers its agents, one a node: GROUP_RANK 0 .. nnodes-1.
    node = int(os.environ["GROUP_RANK"])
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    exp_dir = os.path.join(args.save_dir, args.experiment_name)
    os.makedirs(exp_dir, exist_ok=True)

    torch.manual_seed(args.seed)
    inputs, targets = synthetic_data(args.seed, device)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    checkpoint_path = os.path.join(exp_dir, "checkpoint.pt")
    step = 0
    if os.path.exists(checkpoint_path):
        checkpoint = torch.load(checkpoint_path, map_location=device, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        step = checkpoint["step"]
    model = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)

    global_batch_size = args.batch_size * world_size
    if global_batch_size > len(inputs):
        sys.exit(f"error: a global batch of {global_batch_size} ({world_size} ranks x -b {args.batch_size}) is "
                 f"more than the {len(inputs)} rows of data; pass a smaller -b")
    run = start_wandb(args, exp_dir, rank, local_rank, node, world_size)
    while step < args.max_steps:
        first = step * global_batch_size % (len(inputs) - global_batch_size + 1) + rank * args.batch_size
        rows = slice(first, first + args.batch_size)
        loss = F.mse_loss(model(inputs[rows]), targets[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        # Every rank's (loss, node) in one collective: the global batch's loss is the mean over all ranks, a
        # node's the mean over its ranks. A rank holds only its own loss: logging another takes a collective.
        gathered = torch.zeros(world_size, 2, device=device)
        gathered[rank] = torch.stack([loss.detach(), torch.tensor(float(node), device=device)])
        dist.all_reduce(gathered)
        losses, nodes = gathered.unbind(1)
        metrics = {"loss": losses.mean().item()}
        if args.wandb_mode == "per-node":
            metrics["node_loss"] = losses[nodes == node].mean().item()
        elif args.wandb_mode == "every-rank":
            metrics["local_loss"] = losses[rank].item()
        if rank == 0:
            print(" | ".join(f"{k} {v:.6g}" for k, v in {"step": step, **metrics}.items()))
        if run is not None:
            run.log(metrics, step=step)

    if rank == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                   checkpoint_path)
    if run is not None:
        run.finish()
    # NOTE: free DDP before the process group: freed later, gloo can hang at exit (chapter 02 explains).
    del model
    gc.collect()
    dist.destroy_process_group()


def get_parser():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--wandb-mode", choices=["rank0", "per-node", "every-rank"], default="rank0",
                        help="who logs: rank 0 only, the first process of each node, or every process")
    parser.add_argument("-e", "--experiment-name", default="wandb-modes",
                        help="name of the run (and of the group); relaunching the same name resumes it")
    parser.add_argument("--save-dir", default="outputs", help="where <experiment-name>/ is written")
    parser.add_argument("--max-steps", type=positive_int, default=20)
    parser.add_argument("-b", "--batch-size", type=positive_int, default=8, help="rows per step on this process")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def synthetic_data(seed, device, rows=1024):
    """A noisy linear function of 16 inputs (targets of variance about 1), the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(rows, 16, generator=generator)
    weights = torch.randn(16, 1, generator=generator) / 4
    targets = inputs @ weights + 0.1 * torch.randn(rows, 1, generator=generator)
    return inputs.to(device), targets.to(device)


def start_wandb(args, exp_dir, rank, local_rank, node, world_size):
    """The wandb run this process logs to, or None if it logs nothing in this mode."""
    name = args.experiment_name
    if args.wandb_mode == "rank0" and rank == 0:
        # NOTE: id + resume="allow": a relaunch of the same experiment continues the same run.
        identity = dict(id=name, name=name)
    elif args.wandb_mode == "per-node" and local_rank == 0:
        # A node's index, not its hostname: two agents on one machine (or a renamed node) stay apart.
        identity = dict(id=f"{name}-node{node}", name=f"node{node}", group=name)
    elif args.wandb_mode == "every-rank":
        identity = dict(id=f"{name}-rank{rank}", name=f"rank{rank}", group=name)
    else:
        return None
    import wandb

    return wandb.init(
        project="distributed-training-guide", resume="allow", dir=exp_dir, **identity,
        config={**vars(args), "rank": rank, "node": node, "world_size": world_size,
                "host": socket.gethostname()},
    )


if __name__ == "__main__":
    # NOTE: exit without the interpreter's teardown, as the chapters do: gloo's threads can outlive the
    # process group and hang or abort a finished process (pytorch/pytorch#56297).
    try:
        main()
        exit_code = 0
    except SystemExit as stop:
        exit_code = stop.code if isinstance(stop.code, int) else 1
        if isinstance(stop.code, str):
            sys.stderr.write(stop.code + "\n")
    except Exception:
        traceback.print_exc()
        exit_code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
