"""The first job to run on a new cluster: every rank says where it runs, and one all_reduce proves they meet.

    torchrun --nproc_per_node=2 tools/smoke_test.py
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node0:29500 --rdzv-id smoke \
        tools/smoke_test.py                                            # the same line on every node

Before the process group exists it prints what a multi-node rendezvous depends on: this host's name and the
address that name resolves to (127.x.x.x on a node of a multi-node job is the classic hang: other nodes are
told to connect to their own loopback), and the store address torchrun handed out (MASTER_ADDR:MASTER_PORT).
"""
import argparse
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=60, help="process group timeout in seconds")
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host = socket.gethostname()
    address = socket.gethostbyname(host)
    print(f"rank {rank}/{world_size} (local rank {os.environ['LOCAL_RANK']}) on {host}: {host} resolves to "
          f"{address}; store at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    expected = world_size * (world_size - 1) / 2
    print(f"rank {rank}: all_reduce {'ok' if total.item() == expected else 'WRONG'} "
          f"(sum of ranks {total.item():.0f}, expected {expected:.0f})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # NOTE: os._exit skips the interpreter's teardown, where gloo's leftover threads can abort a finished
    # process ("terminate called without an active exception", pytorch/pytorch#190489): see the README.
    sys.stdout.flush()
    os._exit(0)
