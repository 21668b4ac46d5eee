"""How fast do the ranks talk? The collectives training uses, timed over message sizes, and a per-rank check.

    torchrun --nproc_per_node=2 tools/bandwidth.py                          # gloo on CPUs, 4 KiB to 4 MiB
    torchrun --nproc_per_node=8 tools/bandwidth.py --sizes 1M-4G --plot busbw.png   # nccl on a GPU node
    torchrun --nproc_per_node=8 tools/bandwidth.py --check                  # every rank's link, slow ones named

Sweep (default): all_reduce, all_gather, reduce_scatter and all_to_all, each size timed over --iters calls
after --warmup calls, as the slowest rank saw it. Sizes count as nccl-tests counts them: all_reduce the buffer,
all_gather its output (n pieces), reduce_scatter its input, all_to_all the buffer each rank sends. Per size:

    algbw = size / time                 what one call moved per second, from the caller's side
    busbw = algbw x 2(n-1)/n            all_reduce (reduce-scatter then all-gather: each byte crosses twice)
    busbw = algbw x (n-1)/n             all_gather, reduce_scatter, all_to_all

busbw is the rate each rank's link carried, whatever n is: compare it with the link's speed (NCCL's
doc/PERFORMANCE.md in github.com/NVIDIA/nccl-tests derives the factors).

--check: every pair of ranks exchanges --check-size bytes both ways, one round of disjoint pairs at a time (a
round-robin schedule: n-1 rounds), so each rank measures its link to every other rank. A rank whose median
over its partners falls below the median of all ranks divided by --factor is named with its host: a slow
link, a slow NIC or a throttled GPU. Run it before a long job; it takes seconds.
"""
import argparse
import os
import re
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

# torch 2.13 renamed the one-tensor forms; torch 2.11 has only the old names.
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n}


def main():
    args = get_parser().parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            device_id=device if device.type == "cuda" else None)
    if rank == 0:
        print(f"{world_size} ranks, {dist.get_backend()}, {device.type}, torch {torch.__version__}", flush=True)
    if args.check:
        check_links(args, rank, world_size, device)
    else:
        rows = sweep(args, world_size, device)
        if rank == 0 and args.plot:
            plot(rows, args.plot, f"{world_size} ranks, {dist.get_backend()}")
    dist.destroy_process_group()


def sweep(args, world_size, device):
    """Print one line a collective and size on rank 0; return them as dicts."""
    rows = []
    if dist.get_rank() == 0:
        print(f"{'collective':<15}{'size':>10}{'time (us)':>12}{'algbw (GB/s)':>14}{'busbw (GB/s)':>14}")
    for name in args.collectives:
        for size in args.sizes:
            seconds = time_collective(name, size, world_size, device, args.warmup, args.iters)
            algbw = size / seconds / 1e9
            row = {"collective": name, "bytes": size, "seconds": seconds, "algbw": algbw,
                   "busbw": algbw * BUS_FACTOR[name](world_size)}
            rows.append(row)
            if dist.get_rank() == 0:
                print(f"{name:<15}{human(size):>10}{seconds * 1e6:>12.1f}{algbw:>14.3f}{row['busbw']:>14.3f}",
                      flush=True)
    return rows


def time_collective(name, size, world_size, device, warmup, iters):
    """Seconds per call of one collective moving `size` bytes (counted as above), on the slowest rank."""
    numel = max(world_size, size // 4) // world_size * world_size  # float32, a multiple of n elements
    whole, other = torch.ones(numel, device=device), torch.ones(numel, device=device)
    piece = torch.ones(numel // world_size, device=device)
    calls = {
        "all_reduce": lambda: dist.all_reduce(whole),
        "all_gather": lambda: ALL_GATHER(whole, piece),
        "reduce_scatter": lambda: REDUCE_SCATTER(piece, whole),
        "all_to_all": lambda: dist.all_to_all_single(other, whole),
    }
    for _ in range(warmup):
        calls[name]()
    synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        calls[name]()
    synchronize(device)
    # The slowest rank's time: a collective is as slow as its slowest participant.
    seconds = torch.tensor([(time.perf_counter() - start) / iters], device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def check_links(args, rank, world_size, device):
    """Every pair of ranks exchanges a message both ways; name the ranks whose links are slow."""
    if world_size < 3:
        sys.exit("error: --check compares each rank with the others: it needs 3 or more ranks")
    numel = args.check_size // 4
    send, receive = torch.ones(numel, device=device), torch.empty(numel, device=device)
    speeds = {}
    for partner in round_robin_partners(rank, world_size):
        if partner is None:  # (an odd number of ranks: one sits out each round)
            dist.barrier()
            continue
        seconds = []
        for iteration in range(args.warmup + args.iters):
            synchronize(device)
            start = time.perf_counter()
            # Both directions at once, as a link carries them in training.
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, partner),
                                                dist.P2POp(dist.irecv, receive, partner)]):
                work.wait()
            synchronize(device)
            if iteration >= args.warmup:
                seconds.append(time.perf_counter() - start)
        speeds[partner] = 2 * args.check_size / statistics.median(seconds) / 1e9
        dist.barrier()
    mine = statistics.median(speeds.values())
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (socket.gethostname(), mine))
    if rank != 0:
        return
    typical = statistics.median(speed for _, speed in everyone)
    for other, (host, speed) in enumerate(everyone):
        print(f"rank {other} on {host}: {speed:.3f} GB/s (median over its {world_size - 1} partners)")
    slow = [(other, host, speed) for other, (host, speed) in enumerate(everyone) if speed < typical / args.factor]
    print(f"median over ranks: {typical:.3f} GB/s")
    for other, host, speed in slow:
        print(f"SLOW: rank {other} on {host}: {speed:.3f} GB/s, below {typical / args.factor:.3f} (the median / "
              f"{args.factor:g})")
    if not slow:
        print(f"ok: every rank within a factor {args.factor:g} of the median")
    sys.stdout.flush()


def round_robin_partners(rank, world_size):
    """This rank's partner in each round of a round-robin tournament (the circle method): every pair meets once,
    and the pairs of a round are disjoint, so a round measures n/2 links at once. None: no partner this round."""
    slots = world_size + world_size % 2  # an odd number of ranks gets a dummy slot
    for round_index in range(slots - 1):
        # Slot 0 stays; the others rotate. Slot i plays slot slots-1-i.
        order = [0] + [(slot + round_index) % (slots - 1) + 1 for slot in range(slots - 1)]
        position = order.index(rank)
        partner = order[slots - 1 - position]
        yield partner if partner < world_size else None


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plot(rows, path, title):
    try:
        import matplotlib
    except ModuleNotFoundError:
        sys.exit("error: --plot draws with matplotlib: pip install -r requirements.txt")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(row["collective"] for row in rows):
        mine = [row for row in rows if row["collective"] == name]
        axes.plot([row["bytes"] for row in mine], [row["busbw"] for row in mine], marker="o", label=name)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("message size (bytes)")
    axes.set_ylabel("busbw (GB/s)")
    axes.set_title(title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}")


def human(size):
    for unit, factor in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if size >= factor and size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


def parse_size(text):
    match = re.fullmatch(r"(\d+)([KMG]?)", text.strip().upper())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 4096, 64K, 16M or 1G")
    return int(match[1]) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[match[2]]


def size_range(text):
    """'4K-4M': 4K, 8K, ..., 4M (each size twice the last)."""
    first, _, last = text.partition("-")
    low, high = parse_size(first), parse_size(last or first)
    if low > high:
        raise argparse.ArgumentTypeError(f"{text!r}: the first size is larger than the last")
    sizes = [low]
    while sizes[-1] * 2 <= high:
        sizes.append(sizes[-1] * 2)
    return sizes


def get_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=size_range, default=size_range("4K-4M"),
                        help="message sizes, first-last, doubling (default 4K-4M; on GPUs try 1M-4G)")
    parser.add_argument("--collectives", nargs="+", choices=list(BUS_FACTOR), default=list(BUS_FACTOR))
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first (connections, caches)")
    parser.add_argument("--iters", type=int, default=10, help="timed calls per size")
    parser.add_argument("--plot", help="write busbw against size to this PNG (needs matplotlib)")
    parser.add_argument("--check", action="store_true", help="time every rank's link to every other rank")
    parser.add_argument("--check-size", type=parse_size, default=parse_size("4M"),
                        help="bytes each pair exchanges each way in --check (default 4M)")
    parser.add_argument("--factor", type=float, default=2.0,
                        help="--check names ranks slower than the median by more than this factor")
    return parser


if __name__ == "__main__":
    main()
    # NOTE: os._exit skips the interpreter's teardown, where gloo's leftover threads can abort a finished
    # process ("terminate called without an active exception"): see the README.
    sys.stdout.flush()
    os._exit(0)
