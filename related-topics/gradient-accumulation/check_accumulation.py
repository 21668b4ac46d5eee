"""Gradient accumulation under DDP and FSDP2, checked against one big batch, and the cost of syncing gradients
on every micro-step.

    torchrun --nproc_per_node=2 check_accumulation.py

Every rank builds the same padded global batch: N ranks x K micro-batches x b sequences of random lengths,
labels -100 on the padding, so micro-batches and ranks hold different numbers of tokens. Under DDP and FSDP2
(fully_shard) it accumulates the gradient two ways: each micro-batch's loss summed over its tokens and divided
by the global batch's token count, or each micro-batch's mean loss divided by K. It compares each with the
gradient of the global batch's mean loss, computed in one pass by a plain model. Then it times optimizer
steps with the gradient sync skipped on all but the last micro-step and with a sync on every micro-step.
Results are printed and written to <save-dir>/check_accumulation.json, the batch, the starting weights
and every gradient to check_accumulation.pt.
"""
import argparse
import copy
import gc
import json
import os
import sys
import time
import traceback
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

# (when gradients are synced, what the summed loss is divided by); the last is wrong when token counts differ
CHECKS = [
    ("last micro-step", "global tokens"),
    ("every micro-step", "global tokens"),
    ("last micro-step", "mean / K"),
]


def main():
    args = get_parser().parse_args()
    if "LOCAL_RANK" not in os.environ:
        sys.exit("error: launch this script with torchrun: torchrun --nproc_per_node=2 check_accumulation.py")
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    device = torch.device("cpu")
    model = transformers.AutoModelForCausalLM.from_config(tiny_llama_config(args.hidden_size), dtype=torch.float32)
    input_ids, labels = padded_global_batch(args, world_size)

    reference = copy.deepcopy(model)
    F.cross_entropy(reference(input_ids=input_ids).logits.flatten(0, 1), labels.flatten(0, 1)).backward()
    reference_grads = [p.grad for p in reference.parameters()]

    # This rank's K micro-batches: rows [rank*K*b, (rank+1)*K*b) of the global batch, b at a time.
    rows_per_rank = args.batch_size * args.grad_accum_steps
    mine = slice(rank * rows_per_rank, (rank + 1) * rows_per_rank)
    micro_batches = list(zip(input_ids[mine].split(args.batch_size), labels[mine].split(args.batch_size)))

    runs, wrapped, grads = [], {}, {}
    for wrapper in ("ddp", "fsdp"):
        for sync, normalisation in CHECKS:
            candidate = wrap(copy.deepcopy(model), wrapper)
            accumulate(candidate, micro_batches, wrapper, sync, normalisation)
            grads[f"{wrapper}, {sync}, {normalisation}"] = full_grads(candidate.parameters())
            difference = max_relative_difference(grads[f"{wrapper}, {sync}, {normalisation}"], reference_grads)
            runs.append({"wrapper": wrapper, "sync": sync, "normalisation": normalisation,
                         "max_relative_grad_difference": difference})
            if normalisation == "global tokens":
                wrapped[wrapper, sync] = candidate
    seconds = seconds_per_step(wrapped, micro_batches, args.max_steps)
    costs = {config: step_costs(model, micro_batches, *config, device) for config, model in wrapped.items()}
    for run in runs:
        config = (run["wrapper"], run["sync"])
        run["seconds_per_step"] = seconds.get((*config, run["normalisation"]))
        if run["normalisation"] == "global tokens":
            run["gradient_collectives_per_step"], run["step_peak_mb"] = costs[config]
    if rank == 0:
        report(args, world_size, [int((l != -100).sum()) for l in labels.split(args.batch_size)], runs)
        # What a check of this script needs to compute the one-batch gradient on its own.
        torch.save({"config": model.config.to_dict(), "weights": model.state_dict(), "input_ids": input_ids,
                    "labels": labels, "grads": grads}, os.path.join(args.save_dir, "check_accumulation.pt"))
    # As in chapter 02: free the DDP wrappers before the process group, or the exit can hang.
    del wrapped, candidate
    gc.collect()
    dist.destroy_process_group()


def get_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-b", "--batch-size", type=int, default=8, help="sequences per micro-batch per rank")
    parser.add_argument("--grad-accum-steps", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("-s", "--seq-length", type=int, default=128, help="longest sequence (before padding)")
    parser.add_argument("--max-steps", type=int, default=20, help="optimizer steps timed per configuration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", default="outputs", help="where check_accumulation.json is written")
    parser.add_argument("--hidden-size", type=int, default=128,
                        help="the tiny Llama's width (512 makes the gradients' memory stand out of the noise)")
    return parser


def tiny_llama_config(hidden_size=128):
    # The chapter scripts' tiny Llama (at its default width); no dropout, so the gradients compare exactly.
    return transformers.LlamaConfig(
        vocab_size=272, hidden_size=hidden_size, intermediate_size=3 * hidden_size, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024, bos_token_id=None,
        eos_token_id=1, pad_token_id=0,
    )


def padded_global_batch(args, world_size):
    """Right-padded sequences of random lengths (1/8 to all of seq_length); padding is never a label."""
    rows = world_size * args.grad_accum_steps * args.batch_size
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(2, 272, (rows, args.seq_length + 1), generator=generator)
    lengths = torch.randint(args.seq_length // 8, args.seq_length + 1, (rows, 1), generator=generator)
    padding = torch.arange(args.seq_length + 1) >= lengths
    tokens[padding] = 0
    input_ids, labels = tokens[:, :-1], tokens[:, 1:].clone()
    # Causal attention: real tokens never see the padding after them, so no attention mask is needed.
    labels[padding[:, 1:]] = -100
    return input_ids, labels


def wrap(model, wrapper):
    if wrapper == "ddp":
        return DistributedDataParallel(model, gradient_as_bucket_view=True)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def accumulate(model, micro_batches, wrapper, sync, normalisation):
    world_size = dist.get_world_size()
    num_tokens = sum((labels != -100).sum() for _, labels in micro_batches)
    dist.all_reduce(num_tokens)
    for micro_step, (input_ids, labels) in enumerate(micro_batches):
        skip_sync = sync == "last micro-step" and micro_step < len(micro_batches) - 1
        if wrapper == "fsdp":
            # FSDP2: no reduce-scatter in this backward; the unsharded gradients add up until one that syncs.
            model.set_requires_gradient_sync(not skip_sync)
        with model.no_sync() if wrapper == "ddp" and skip_sync else nullcontext():
            logits = model(input_ids=input_ids).logits.flatten(0, 1)
            if normalisation == "global tokens":
                # DDP and FSDP2 both divide the summed gradients by the world size: x world_size undoes it.
                loss = F.cross_entropy(logits, labels.flatten(), reduction="sum") * world_size / num_tokens
            else:
                loss = F.cross_entropy(logits, labels.flatten()) / len(micro_batches)
            loss.backward()


def full_grads(parameters):
    """Every parameter's whole gradient (FSDP's sharded ones gathered: every rank must call this)."""
    return [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone() for p in parameters]


def max_relative_difference(grads, reference_grads):
    scale = max(g.abs().max().item() for g in reference_grads)
    return max((g - r).abs().max().item() for g, r in zip(grads, reference_grads)) / scale


def seconds_per_step(wrapped, micro_batches, steps):
    """Mean wall time of an optimizer step for each (wrapper, sync), over `steps` steps after an untimed one.
    The configurations take turns step by step, so a change in the machine's load hits them all alike."""
    optimizers = {config: torch.optim.AdamW(model.parameters(), lr=1e-4) for config, model in wrapped.items()}
    total = dict.fromkeys(wrapped, 0.0)
    for step in range(steps + 1):
        for (wrapper, sync), model in wrapped.items():
            dist.barrier()
            started = time.perf_counter()
            optimizers[wrapper, sync].zero_grad(set_to_none=True)
            accumulate(model, micro_batches, wrapper, sync, "global tokens")
            optimizers[wrapper, sync].step()
            dist.barrier()
            if step > 0:
                total[wrapper, sync] += time.perf_counter() - started
    return {(*config, "global tokens"): seconds / max(1, steps) for config, seconds in total.items()}


def step_costs(model, micro_batches, wrapper, sync, device):
    """One step's gradient collectives (DDP's all-reduces or FSDP's reduce-scatters, counted in a profile) and
    its peak memory above what the process held before it: CUDA's allocator, or on a CPU the resident set
    (Linux's VmHWM, reset first; run with MALLOC_MMAP_THRESHOLD_=65536 so freed buffers leave it at once)."""
    model.zero_grad(set_to_none=True)
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = resident_bytes("VmRSS")
    accumulate(model, micro_batches, wrapper, sync, "global tokens")
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else resident_bytes("VmHWM")
    peak -= before
    model.zero_grad(set_to_none=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        accumulate(model, micro_batches, wrapper, sync, "global tokens")
    collectives = sum(1 for event in profile.events()
                      if event.name in ("c10d::allreduce_", "c10d::_reduce_scatter_base_", "c10d::reduce_scatter_"))
    model.zero_grad(set_to_none=True)
    return collectives, peak / 2**20


def resident_bytes(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def report(args, world_size, tokens_per_micro_batch, runs):
    print(f"{world_size} ranks x {args.grad_accum_steps} micro-batches x {args.batch_size} padded sequences; "
          f"label tokens per micro-batch: {tokens_per_micro_batch}")
    print(f"{'wrapper':8} {'gradient sync':18} {'loss divided by':16} {'max |g - g_one_batch|':>22} "
          f"{'s/step':>8} {'tokens/s':>9} {'collectives':>11} {'step peak MB':>12}")
    for run in runs:
        seconds = run["seconds_per_step"]
        timing = f"{seconds:8.3f} {sum(tokens_per_micro_batch) / seconds:9.0f}" if seconds else ""
        costs = (f" {run['gradient_collectives_per_step']:11d} {run['step_peak_mb']:12.1f}"
                 if "step_peak_mb" in run else "")
        print(f"{run['wrapper']:8} {run['sync']:18} {run['normalisation']:16} "
              f"{run['max_relative_grad_difference']:22.1e} {timing}{costs}")
    print("(gradient differences relative to the largest gradient; tokens/s counts label tokens, all ranks;")
    print(" collectives: a step's gradient all-reduces or reduce-scatters on this rank; step peak: rank 0's)")
    os.makedirs(args.save_dir, exist_ok=True)
    results = {**vars(args), "world_size": world_size, "tokens_per_micro_batch": tokens_per_micro_batch,
               "runs": runs}
    with open(os.path.join(args.save_dir, "check_accumulation.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    # Leave through os._exit, as the chapter scripts do: gloo's threads can hang or abort the interpreter's
    # teardown (chapter 02's README, "A trap: hang at exit").
    try:
        main()
        exit_code = 0
    except SystemExit as stop:
        if isinstance(stop.code, str):
            sys.stderr.write(stop.code + "\n")
        exit_code = stop.code if isinstance(stop.code, int) else 1
    except Exception:
        traceback.print_exc()
        exit_code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
