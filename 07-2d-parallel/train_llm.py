"""Train a causal language model on many devices with 2D parallelism: FSDP2 across groups, TP within each.

    torchrun --nproc_per_node=4 train_llm.py --tp 2       # tiny Llama, offline corpus, any laptop
    torchrun --nproc_per_node=8 train_llm.py --tp 4 -m meta-llama/Llama-3.1-8B -d roneneldan/TinyStories

Chapter 06's script plus FSDP2 over the data-parallel dimension of a (dp, tp) device mesh: each group of --tp
ranks splits every layer as in chapter 06 and computes one slice of the batch, and FSDP shards each rank's
slices again across the groups. Checkpoints and export are chapter 06's.
"""
import argparse
import ctypes
import errno
import functools
import gc
import json
import math
import os
import random
import resource
import shutil
import signal
import sys
import tempfile
import textwrap
import time
import traceback
from dataclasses import dataclass
from contextlib import contextmanager

import datasets
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import transformers
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, loss_parallel, parallelize_module,
)
from tqdm import tqdm


# @record writes an uncaught exception's traceback where torchrun's failure report shows it.
@record
def main():
    args = get_parser().parse_args()
    check_args(args)
    # Schedulers (Slurm preemption, time limits) send a signal before they kill a job, and Ctrl-C sends SIGINT:
    # we finish the current step, save a checkpoint and exit, so a relaunch of the same command loses nothing.
    stop_signals = stop_on_signals()

    # torchrun sets these for each process. LOCAL_RANK, not rank % device_count, picks this node's GPU.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = set_up_device(local_rank=int(os.environ["LOCAL_RANK"]))
    # nccl moves CUDA tensors between GPUs, gloo CPU tensors; device_id binds nccl to our GPU at once.
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    # Weights and optimizer state stay fp32 (the "master" copy); only the forward/backward math runs in --dtype.
    # Pure bf16 weights lose small updates: at lr 3e-5 most bf16 weights would never change.
    compute_dtype = getattr(torch, args.dtype or default_compute_dtype(device))
    torch.manual_seed(args.seed)

    config, tokenizer = load_config_and_tokenizer(args)
    if world_size % args.tp:
        sys.exit(f"error: --tp {args.tp} does not divide the {world_size} ranks; pass a divisor of the "
                 "processes per node (a TP group must stay inside one node)")
    check_tensor_parallel_fits(config, args.seq_length, args.tp)
    # Every rank builds (or loads) the whole model from the same seed, exactly as chapter 01 does, then keeps
    # only its slices: the weights equal chapter 01's. This needs the full fp32 model in memory once, at start.
    model = build_model(args, config, device)
    # NOTE: the mesh is a dp x tp grid in rank order: ranks [g*tp, (g+1)*tp) form TP group g. torchrun numbers
    # the processes of a node consecutively, so a TP group (a collective in every layer) stays on NVLink and
    # only FSDP's per-block all-gathers and reduce-scatters cross nodes.
    mesh = init_device_mesh(device.type, (world_size // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    # TP first, then FSDP: fully_shard shards the DTensors that TP made (dim 0 of each rank's slice) over dp.
    tensor_parallelize(model, mesh["tp"])
    shard_model(model, mesh["dp"], compute_dtype)
    param_shapes = {name: list(p.shape) for name, p in model.named_parameters()}
    flops_per_token = training_flops_per_token(model, config, args.seq_length)
    if rank == 0:
        print(f"model: {model.num_parameters() / 1e6:.1f}M parameters, compute in {compute_dtype}")

    # Rank 0 fills the datasets cache first; the others then read it instead of racing to write it.
    if rank != 0:
        datasets.disable_progress_bars()
    with rank_0_first():
        data, val_data = load_and_pack(args, tokenizer)
    # Each TP group computes its rows together, --grad-accum-steps micro-batches of -b rows a step; the dp
    # groups split the data, as in chapter 04.
    dp_rank, dp_size = mesh.get_local_rank("dp"), mesh["dp"].size()
    fit_grad_accum_steps(args, dp_size)
    rows_per_rank = args.batch_size * args.grad_accum_steps
    global_batch_size = rows_per_rank * dp_size
    tokens_per_step = global_batch_size * args.seq_length
    data, val_data = hold_out_validation(data, val_data, global_batch_size, args)
    check_one_batch_fits(len(data), global_batch_size, args)
    if rank == 0:
        print(f"global batch: {global_batch_size} sequences ({dp_size} dp groups x -b {args.batch_size} x "
              f"{args.grad_accum_steps} micro-batches); {len(val_data) if val_data else 'no'} validation rows")
    # --max-steps, when given, wins over --num-epochs (as in Hugging Face's Trainer): the data order repeats.
    total_steps = args.max_steps or len(data) // global_batch_size * args.num_epochs
    warn_if_mostly_warmup(args.warmup_steps, total_steps)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=device.type == "cuda")
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_then_cosine(step, args.warmup_steps, total_steps))

    fixed_flags = flags_a_relaunch_must_keep(args, global_batch_size)
    exp_dir = make_experiment_dir(args.save_dir, args.experiment_name)
    checkpoint_dir, state = load_newest_checkpoint(
        exp_dir, lambda folder: load_checkpoint(folder, model, optimizer, lr_schedule, param_shapes, fixed_flags),
        fresh_state=TrainState(fixed_flags))
    if checkpoint_dir is not None:
        check_resume_step(state.step, total_steps, checkpoint_dir)
        print(f"rank {rank}: resumed from {checkpoint_dir} at step {state.step}")
    metrics_path = os.path.join(exp_dir, "metrics.jsonl")
    if rank == 0:
        truncate_metrics(metrics_path, after_step=state.step)

    # Compile AFTER parallelizing, each block on its own as torchtitan does (with FSDP and TP together, compiling
    # the whole model fails in dynamo, torch 2.13): each graph holds its block's collectives.
    if args.compile:
        for block in model.model.layers:
            block.compile()
    wandb_run = start_wandb(args, exp_dir) if args.wandb and rank == 0 else None

    peak_flops = peak_flops_per_second(device)
    if rank == 0 and peak_flops is not None:
        print(f"MFU is relative to {peak_flops / 1e12:.0f} TFLOP/s, the dense bf16 peak of this GPU")
    eval_freq = args.eval_freq or args.ckpt_freq
    stop = False
    running_loss = torch.tensor(0.0, device=device)
    progress = tqdm(total=total_steps, initial=state.step, desc="training",
                    disable=rank != 0 or not sys.stderr.isatty())
    last_log_time, last_log_step = time.perf_counter(), state.step
    profiler = start_profiler(exp_dir, state.step, total_steps) if args.profile else None
    model.train()

    while state.step < total_steps:
        rows = next_global_batch(data, state, global_batch_size, args.seed)
        # The step's loss is the mean over all label tokens of the global batch, as one pass over it would give:
        # each micro-batch's summed loss over that count (a micro-batch of rows with masked prompts has fewer
        # label tokens and must weigh less). Every rank reads all the batch's rows and counts them: no all-reduce.
        num_label_tokens = count_label_tokens(rows)
        # NOTE: slice by the dp rank, not the rank: all ranks of a TP group must see the same rows (else TP
        # would mix the tokens of different sequences). dp groups at -b b see what one process sees at -b dp*b.
        rows = {key: value[dp_rank * rows_per_rank : (dp_rank + 1) * rows_per_rank] for key, value in rows.items()}
        input_ids, labels = inputs_and_labels(rows, device)
        for micro_input_ids, micro_labels in zip(input_ids.split(args.batch_size), labels.split(args.batch_size)):
            # No autocast, as in chapter 04: FSDP's MixedPrecisionPolicy hands every block its weights in --dtype.
            logits = model(input_ids=micro_input_ids, use_cache=False).logits
            # NOTE: the logits stay split over the vocabulary, one slice per rank. loss_parallel computes the
            # cross-entropy from the slices (all-reducing each row's max, sum of exponentials and target logit),
            # so the full logits never exist on one device. Its backward needs the same context.
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1).float(), micro_labels.flatten(0, 1), reduction="sum")
                # x dp_size: FSDP averages the dp groups' gradients, and the log line their losses.
                loss = loss * dp_size / num_label_tokens
                loss.backward()
            # NOTE: nothing in a step reads a value back from the GPU (.item(), printing a tensor): the CPU queues
            # the next step while the GPU computes this one. Losses are summed on the device until a log step.
            # The loss is a replicated DTensor: each rank's local value is the whole micro-batch's loss.
            running_loss += loss.detach().to_local()
        # Every parameter is a DTensor on the 2D mesh, so the norm adds up the pieces of every rank, dp and tp.
        # NOTE: foreach=False: on torch 2.11 the fused in-place multiply that clips does nothing to a gradient
        # still pending its all-reduce (Partial, the sequence-parallel norms'), so those would go unclipped.
        grad_norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), args.max_grad_norm, foreach=False
        ).full_tensor()
        optimizer.step()
        # Read before the schedule advances, so the logged lr is the one this step used.
        step_lr = lr_schedule.get_last_lr()[0]
        lr_schedule.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        progress.update(1)

        # A checkpoint step logs too: a checkpoint then holds no losses summed for a log line still to come.
        checkpoint_now = state.step % args.ckpt_freq == 0 or state.step == total_steps
        # The validation loss, at each checkpoint (or --eval-freq) and at the end, gets a log line of its own.
        evaluate_now = val_data is not None and (state.step % eval_freq == 0 or state.step == total_steps)
        if state.step % args.log_freq == 0 or checkpoint_now or evaluate_now:
            # NOTE: one all-reduce per log step sums the ranks' losses (their mean is the global batch's) and
            # stop votes: a signal may reach one rank only, and all must stop after the same log step.
            (loss_sum,), stop = all_reduce_sums_and_stop_votes([running_loss], stop_signals)
            mean_loss = loss_sum / world_size / (state.step - last_log_step)
            tokens_per_s = tokens_per_step * (state.step - last_log_step) / (time.perf_counter() - last_log_time)
            metrics = {"step": state.step, "epoch": state.epoch, "loss": mean_loss, "grad_norm": grad_norm.item(),
                       "lr": step_lr, "tokens_per_s": tokens_per_s, "peak_memory_gb": peak_memory_gb(device)}
            if evaluate_now:
                metrics["val_loss"] = evaluate(model, val_data, args, device, mesh["dp"])
            exit_if_diverged(state.step, mean_loss, metrics["grad_norm"])
            if peak_flops is not None:
                # tokens_per_s counts the tokens of all ranks, so the peak is that of all their GPUs.
                metrics["mfu"] = tokens_per_s * flops_per_token / (peak_flops * world_size)
            if rank == 0:
                log_metrics(metrics_path, metrics, progress)
            if wandb_run is not None:
                wandb_run.log(metrics, step=state.step)
            running_loss.zero_()
            last_log_time, last_log_step = time.perf_counter(), state.step

        if stop or checkpoint_now:
            # Each rank holds different slices, so every rank writes its own part of the checkpoint.
            save_checkpoint(exp_dir, state, param_shapes, model, optimizer, lr_schedule)
        if profiler is not None:
            profiler.step()
        if stop:
            break

    progress.close()
    if profiler is not None:
        profiler.stop()
    if state.step == total_steps:
        export_hf(os.path.join(exp_dir, "hf"), model, tokenizer)
    if wandb_run is not None:
        wandb_run.finish()
    # NOTE: free the model before the process group: freed later, its gloo state is destroyed while a
    # communication thread waits for the GIL, and the process hangs. --compile keeps a cycle only gc frees.
    del model
    gc.collect()
    dist.destroy_process_group()
    if state.step < total_steps:
        sys.exit(f"stopped by a signal after step {state.step}; relaunch the same command to resume")


def build_model(args, config, device):
    # Building under `with device` allocates the weights directly on the GPU, not in host RAM first.
    with exit_on_build_error(args), device:
        if args.from_pretrained:
            return transformers.AutoModelForCausalLM.from_pretrained(
                args.model_name, dtype=torch.float32, attn_implementation=args.attn_implementation
            )
        return transformers.AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=args.attn_implementation
        )


def shard_model(model, dp_mesh, compute_dtype):
    """fully_shard each transformer block, then the root (embedding, final norm and head), over the dp ranks.
    A block's slices are all-gathered across dp just before it runs and freed after, and its gradients are
    reduce-scattered (averaged over dp) as soon as they are complete, as in chapter 04."""
    # The fp32 shards are the master weights: param_dtype casts them to --dtype for compute; reduce_dtype=fp32
    # sums gradients in fp32, so small ones are not lost.
    mp_policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for block in model.get_submodule("model.layers"):
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)


def tensor_parallelize(model, tp_mesh):
    """Split a Llama-family model over the ranks of tp_mesh, in place.

    Inside each block, the first matmuls are split by output columns (each rank computes some heads, some MLP
    channels) and the last by input rows (each rank adds its part; the sum needs one collective). Between
    blocks, the sequence is split (sequence parallelism): norms and residual adds run on 1/N of the tokens.
    Layouts: Replicate() = every rank holds the whole tensor, Shard(d) = each rank holds a slice along dim d.
    """
    # Each block does one all-gather (sequence slices -> whole sequence) before its column-wise matmuls and one
    # reduce-scatter (partial sums -> summed sequence slices) after its row-wise matmul, twice a layer.
    # The gathered input stays a DTensor into q, k and v (gate and up): backward adds their partial input
    # gradients, then reduce-scatters once. As local tensors each would be all-reduced on its own (5 a layer).
    plan = {
        # Vocabulary-parallel embedding: rank r holds rows [r*V/N, (r+1)*V/N); each token's vector comes from
        # the rank that holds its row (the others add zeros) in the reduce-scatter. The output stays a DTensor
        # so that the model sees the full sequence length (positions and causal mask).
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        ),
        "model.layers.*.input_layernorm": SequenceParallel(),
        "model.layers.*.self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        ),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "model.layers.*.post_attention_layernorm": SequenceParallel(),
        "model.layers.*.mlp": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "model.norm": SequenceParallel(),
        # The output head keeps the logits split over the vocabulary for loss_parallel.
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    for name in plan:
        try:
            model.get_submodule(name.replace("*", "0"))
        except AttributeError:
            sys.exit(
                "error: the tensor-parallel plan is written for the Llama family (Llama, Mistral, Qwen, Gemma), "
                f"but {type(model).__name__} has no module {name!r}; use such a model or write its plan"
            )
    block = model.get_submodule("model.layers.0")
    # Gemma 2 and 3 also normalise the MLP's input and output: on sequence slices, as the other norms.
    for extra_norm in ["pre_feedforward_layernorm", "post_feedforward_layernorm"]:
        if hasattr(block, extra_norm):
            plan[f"model.layers.*.{extra_norm}"] = SequenceParallel()
    # Qwen3 and Gemma 3 normalise each head's queries and keys. A rank holds some heads: the norm runs on them
    # (over head_dim) with the whole weight on every rank; the sharded dim only has to be another one.
    for per_head_norm in ["q_norm", "k_norm"]:
        if hasattr(block.self_attn, per_head_norm):
            plan[f"model.layers.*.self_attn.{per_head_norm}"] = SequenceParallel(
                sequence_dim=2, use_local_output=True
            )
    # NOTE: models like Llama 3.2 1B share one matrix between embedding and output head. Parallelizing replaces
    # each module's parameter with a new one, so tie them again, or they would train apart.
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    parallelize_module(model, tp_mesh, plan)
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    # A parameter the plan does not place stays a plain tensor on each rank: it would train apart on each and
    # fail in clip_grad_norm_ at step 1. Name it now instead.
    unplaced = [name for name, param in model.named_parameters() if not isinstance(param, DTensor)]
    if unplaced:
        sys.exit(
            f"error: the tensor-parallel plan places no layout on {unplaced[0]} ({len(unplaced)} parameters in "
            f"all) of {type(model).__name__}; add its module to the plan in tensor_parallelize"
        )


def check_tensor_parallel_fits(config, seq_length, tp_size):
    """Every size the plan splits must divide by the number of ranks. Fail at once, before any weights load,
    naming every size that does not and every number of ranks that would work."""
    split_sizes = {
        "attention heads": config.num_attention_heads,
        "key/value heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        # 0 (divides by anything) where a model has no such setting: GPT-2, say, which tensor_parallelize
        # then turns away with its own error.
        "MLP channels (intermediate_size)": getattr(config, "intermediate_size", 0),
        "vocabulary entries": config.vocab_size,
        "tokens per sequence (-s, split by sequence parallelism)": seq_length,
    }
    not_dividing = [f"{size} {what}" for what, size in split_sizes.items() if size % tp_size]
    if not_dividing:
        # The model's sizes fix which counts can work; -s can be changed to suit any of them.
        model_common = math.gcd(*(size for what, size in split_sizes.items() if not what.startswith("tokens")))
        counts = [n for n in range(1, model_common + 1) if model_common % n == 0]
        working = ", ".join(str(n) for n in counts if seq_length % n == 0)
        ways = [f"pass --tp {working} (these divide them all)"]
        ways += [f"--tp {n} with -s {seq_length // n * n}"
                 for n in counts if seq_length % n and seq_length > n]
        sys.exit(
            f"error: tensor parallelism over {tp_size} ranks splits sizes that do not divide by {tp_size}: "
            f"{', '.join(not_dividing)}; {', or '.join(ways)}"
        )


def save_checkpoint(exp_dir, state, param_shapes, model, optimizer, lr_schedule):
    with checkpoint_folder(exp_dir, state, param_shapes, "sharded (DCP)") as folder:
        # get_state_dict names shards by parameter name and offsets: a checkpoint of N ranks loads into any number.
        # dcp.save writes a file per rank, then rank 0 the index (.metadata); every node must see the folder.
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)
        # The data order has its own generator; the RNG states cover anything random in the model (dropout).
        training_state = {"lr_schedule": lr_schedule.state_dict(), "rng": rng_state()}
        if dist.get_rank() == 0:
            torch_save(training_state, os.path.join(folder, "checkpoint.pt"))


def load_checkpoint(checkpoint_dir, model, optimizer, lr_schedule, param_shapes, fixed_flags):
    state = TrainState(**read_checkpoint_state(checkpoint_dir, param_shapes, fixed_flags, "sharded (DCP)"))
    checkpoint = torch.load(os.path.join(checkpoint_dir, "checkpoint.pt"), map_location="cpu", weights_only=True)
    # dcp.load fills these tensors in place, each rank reading its own shards. The optimizer's state goes through
    # get_state_dict/set_state_dict: optimizer.state_dict() of a fresh optimizer has no tensors to fill.
    model_state, optimizer_state = get_state_dict(model, optimizer)
    sharded_state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(sharded_state, checkpoint_id=checkpoint_dir)
    set_state_dict(
        model, optimizer, model_state_dict=sharded_state["model"], optim_state_dict=sharded_state["optimizer"]
    )
    lr_schedule.load_state_dict(checkpoint["lr_schedule"])
    set_rng_state(checkpoint["rng"])
    return state


def export_hf(hf_dir, model, tokenizer):
    """Write the trained model in Hugging Face format: AutoModelForCausalLM.from_pretrained(hf_dir) loads it."""
    # Rank 0 gathers the full weights into CPU memory one tensor at a time and holds them until they are written.
    full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return
    # A tied matrix (one parameter under two names) comes back as two copies. Pointing both names at one
    # copy lets HF see the tie and save the matrix once, as chapter 01 does.
    first_copy = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        full_state[name] = first_copy.setdefault(param, full_state[name])
    model.save_pretrained(hf_dir, state_dict=full_state)
    tokenizer.save_pretrained(hf_dir)
    print(f"saved the trained model to {hf_dir}")


@torch.no_grad()
# NOTE: torch 2.13 fails to run a compiled tensor-parallel block under no_grad (the inference graph loses
# a DTensor's wrapper): the validation batches run the blocks eagerly, as without --compile.
@torch.compiler.set_stance("force_eager")
def evaluate(model, val_data, args, device, dp_mesh):
    """The mean loss over every label token of the validation rows, in eval mode (no dropout): each dp group
    computes its slice of the rows, one all-reduce over dp sums the slices' losses."""
    model.eval()
    rows_per_group = len(val_data) // dp_mesh.size()
    first_row = dp_mesh.get_local_rank() * rows_per_group
    loss_sum = torch.zeros((), device=device)
    for start in range(first_row, first_row + rows_per_group, args.batch_size):
        input_ids, labels = inputs_and_labels(val_data[start : start + args.batch_size], device)
        logits = model(input_ids=input_ids, use_cache=False).logits
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")
        loss_sum += loss.to_local()
    dist.all_reduce(loss_sum, group=dp_mesh.get_group())
    model.train()
    return loss_sum.item() / count_label_tokens(val_data[:])


def all_reduce_sums_and_stop_votes(running_sums, stop_signals):
    """Every rank must call this (an all-reduce): each running sum (losses) summed over the ranks, and whether
    any rank has a stop signal (a signal may reach one rank only, and all must stop after the same step)."""
    stop_vote = torch.tensor(1.0 if stop_signals else 0.0, device=running_sums[0].device)
    totals = torch.stack([*running_sums, stop_vote])
    dist.all_reduce(totals)
    *sums, stop_votes = totals.tolist()
    return sums, stop_votes > 0


def get_parser():
    parser = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model-name", type=path_or_hub_id, default=None,
                        help="Hugging Face model id or local folder (default: a tiny Llama built offline)")
    parser.add_argument("--from-pretrained", action="store_true",
                        help="load the weights of -m (default: fresh weights from -m's config)")
    parser.add_argument("-d", "--dataset-name", type=path_or_hub_id, default=None,
                        help="Hugging Face dataset id, or a local file/folder of .txt/.json/.jsonl/.parquet/.csv "
                             "with a 'text' column (default: an offline synthetic corpus)")
    parser.add_argument("--dataset-subset", default=None, help="dataset configuration, e.g. wikitext-2-raw-v1")
    parser.add_argument("-b", "--batch-size", type=positive_int, default=8,
                        help="sequences per micro-batch on this device")
    parser.add_argument("--grad-accum-steps", type=positive_int, default=1,
                        help="micro-batches per optimizer step, their gradients added up first")
    parser.add_argument("--global-batch-size", type=positive_int, default=None,
                        help="sequences per optimizer step over all ranks: sets --grad-accum-steps to make it")
    parser.add_argument("-s", "--seq-length", type=positive_int, default=128, help="tokens per sequence")
    parser.add_argument("--lr", type=positive_float, default=1e-3, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=non_negative_int, default=20)
    parser.add_argument("--max-steps", type=positive_int, default=None,
                        help="train this many steps, over as many epochs as that takes (default: --num-epochs)")
    parser.add_argument("--num-epochs", type=positive_int, default=1)
    parser.add_argument("--max-grad-norm", type=positive_float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="compute dtype (default: bfloat16 on GPUs that have it, else float32); "
                             "weights stay float32")
    parser.add_argument("--attn-implementation", default=None,
                        help="sdpa, eager or flash_attention_2 (default: sdpa, or eager if the model lacks it)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("-e", "--experiment-name", default="default",
                        help="name of the run; relaunching the same name resumes it")
    parser.add_argument("--save-dir", default="outputs", help="where <experiment-name>/ is written")
    parser.add_argument("--ckpt-freq", type=positive_int, default=100,
                        help="save a checkpoint every this many steps")
    parser.add_argument("--log-freq", type=positive_int, default=10, help="log metrics every this many steps")
    parser.add_argument("--val-fraction", type=fraction, default=0.01,
                        help="rows held out for validation if the dataset has no validation split (0: none)")
    parser.add_argument("--eval-freq", type=positive_int, default=None,
                        help="validation loss every this many steps and at the end (default: at each checkpoint)")
    parser.add_argument("--wandb", action="store_true", help="log to Weights & Biases")
    parser.add_argument("--profile", action="store_true",
                        help="record steps 3-4 with torch.profiler: <experiment>/profile/rank-N.json")
    parser.add_argument("--tp", type=positive_int, default=1,
                        help="ranks that split each layer (tensor parallel), inside one node; dp = ranks / tp")
    return parser


def set_up_device(local_rank):
    """This process's GPU, the local_rank-th of its node (else the CPU), made the current one."""
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # float32 matmuls (--dtype float32, and any outside autocast) run on TF32 tensor cores: several times
        # faster, with a 10-bit mantissa that training tolerates. Weights and optimizer state stay float32.
        torch.set_float32_matmul_precision("high")
    return device


def load_config_and_tokenizer(args):
    """-m's config and tokenizer, or the tiny Llama's with a byte tokenizer (nothing to download)."""
    if args.model_name is None:
        config, tokenizer = tiny_llama_config(), transformers.ByT5Tokenizer(extra_ids=0)
    else:
        with exit_on_error(f"cannot load model {args.model_name!r}",
                           "pass a Hugging Face model id or a local folder with config.json and a tokenizer"):
            config = transformers.AutoConfig.from_pretrained(args.model_name)
            tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_name)
    check_model_fits_tokenizer(args, config, tokenizer)
    return config, tokenizer


def tiny_llama_config():
    # vocab 272 = ByT5's 259 byte tokens rounded up so it divides by 2, 4, 8, 16 (tensor parallel shards).
    return transformers.LlamaConfig(
        vocab_size=272, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=1024, bos_token_id=None, eos_token_id=1, pad_token_id=0,
    )


def load_and_pack(args, tokenizer):
    """The training rows and the validation rows (None if the dataset has no validation split): every document
    tokenized, documents joined with EOS between them, the token stream cut into rows of seq_length + 1 tokens.
    A dataset with a 'prompt' column trains on each 'text' after its prompt: the prompt's tokens get label
    -100 (a 'labels' column beside 'input_ids'), so they are read, never predicted. datasets caches the rows."""
    if args.dataset_name is None:
        splits = [datasets.Dataset.from_dict({"text": tiny_corpus()}), None]
    else:
        splits = load_raw_dataset(args.dataset_name, args.dataset_subset)
    check_text_column(splits[0], args.dataset_name)
    row_length = args.seq_length + 1
    eos = tokenizer.eos_token_id

    def tokenize_and_pack(batch):
        has_prompt = "prompt" in batch
        kept = [index for index, text in enumerate(batch["text"]) if text]
        # (with a prompt, the special tokens a tokenizer adds, such as BOS, go before the prompt)
        texts = tokenizer([batch["text"][i] for i in kept], add_special_tokens=not has_prompt)["input_ids"] \
            if kept else []
        prompts = tokenizer([batch["prompt"][i] or "" for i in kept])["input_ids"] if has_prompt and kept \
            else [[] for _ in kept]
        stream, labels = [], []
        for prompt_ids, ids in zip(prompts, texts):
            if eos is not None and (not ids or ids[-1] != eos):
                ids = ids + [eos]
            stream += prompt_ids + ids
            labels += [-100] * len(prompt_ids) + ids
        rows = {"input_ids": stream, "labels": labels} if has_prompt else {"input_ids": stream}
        num_rows = len(stream) // row_length
        return {key: [tokens[i * row_length : (i + 1) * row_length] for i in range(num_rows)]
                for key, tokens in rows.items()}

    packed = [None if raw is None else raw.map(
        tokenize_and_pack, batched=True, batch_size=1000, remove_columns=raw.column_names,
        desc=f"tokenize and pack into rows of {row_length}",
    ).with_format("numpy") for raw in splits]
    return packed


def hold_out_validation(data, val_data, global_batch_size, args):
    """The training rows and the validation rows, as whole global batches. Without a validation split,
    --val-fraction of the rows (at least one global batch) are drawn by --seed and held out: the same rows in
    every chapter and on any number of ranks at the same global batch, and never trained on."""
    if val_data is None and args.val_fraction > 0:
        num_val = min(len(data), math.ceil(args.val_fraction * len(data) / global_batch_size) * global_batch_size)
        held_out = np.random.default_rng([args.seed, len(data)]).permutation(len(data))
        val_data = data.select(np.sort(held_out[:num_val]))
        data = data.select(np.sort(held_out[num_val:]))
    if val_data is not None:
        val_data = val_data.select(range(len(val_data) // global_batch_size * global_batch_size))
    return data, val_data if val_data is not None and len(val_data) else None


def inputs_and_labels(rows, device):
    """A batch's model inputs and next-token labels, row[:-1] and row[1:]: every token is a label but a
    prompt's, which is -100 (ignored by cross_entropy)."""
    input_ids = to_device(rows["input_ids"], device)
    labels = to_device(rows["labels"], device) if "labels" in rows else input_ids
    # NOTE: copies, not views: torch 2.11's pipeline stages (chapter 08) reject a view's strides.
    return input_ids[:, :-1].contiguous(), labels[:, 1:].contiguous()


def count_label_tokens(rows):
    """The number of tokens that rows have a label for (not -100), counted on the CPU: no GPU sync."""
    if "labels" in rows:
        return int((rows["labels"][:, 1:] != -100).sum())
    return rows["input_ids"][:, 1:].size


def training_flops_per_token(model, config, seq_length):
    """6 FLOPs per matmul weight per token (2 forward, 4 backward), plus the attention scores
    (12 * layers * hidden * seq_length, PaLM appendix B). Every weight is a matmul weight except the input
    embedding (a lookup); a tied output head is that same tensor used again, as a matmul."""
    embedding = model.get_input_embeddings().weight
    num_matmul_params = sum(p.numel() for p in model.parameters() if p is not embedding)
    if model.get_output_embeddings().weight is embedding:
        num_matmul_params += embedding.numel()
    return 6 * num_matmul_params + 12 * config.num_hidden_layers * config.hidden_size * seq_length


def warmup_then_cosine(step, warmup_steps, total_steps, final_fraction=0.1):
    """Multiplier of the peak learning rate: linear warmup, then one cosine down to final_fraction at the end."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * progress))


def flags_a_relaunch_must_keep(args, global_batch_size):
    """By flag name, what a relaunch must not change. -b, --grad-accum-steps and the number of ranks may change,
    not the global batch they make (it sets what a step is, and which rows are held out)."""
    return {"--dataset-name": args.dataset_name, "--dataset-subset": args.dataset_subset,
            "--seq-length": args.seq_length, "--seed": args.seed, "--lr": args.lr,
            "--warmup-steps": args.warmup_steps, "--val-fraction": args.val_fraction,
            "--global-batch-size": global_batch_size}


@dataclass
class TrainState:
    """What state.json keeps besides the tensors: the data position (an epoch's order is a function of --seed
    and the epoch alone) and the fixed flags."""
    fixed_flags: dict
    step: int = 0
    epoch: int = 0
    samples_in_epoch: int = 0


def next_global_batch(data, state, global_batch_size, seed):
    """The rows of the next step, in the epoch's order; the next epoch once this one has too few rows left."""
    if state.samples_in_epoch + global_batch_size > len(data):
        state.epoch += 1
        state.samples_in_epoch = 0
    start = state.samples_in_epoch
    state.samples_in_epoch += global_batch_size
    return data[epoch_order(len(data), seed, state.epoch)[start : start + global_batch_size]]


@functools.lru_cache(maxsize=1)  # (one permutation of all rows an epoch, not one a step)
def epoch_order(num_rows, seed, epoch):
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


# ============================================================================================================
# The plumbing, the same in every chapter (inputs, logs, checks, errors, signals, checkpoints, exit): skip it.


# --- Inputs and records: the offline corpus, data files, RNG states, the GPU's peak, the metrics file ---


def default_compute_dtype(device):
    # Not emulated: a GPU older than Ampere has no bf16 tensor cores, and emulated bf16 is slower than fp32.
    native_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    return "bfloat16" if native_bf16 else "float32"


def tiny_corpus(num_documents=4000, seed=1234):
    """Short stories with structure a tiny model can learn in a minute: templates, names and sums."""
    rng = random.Random(seed)
    names = ["Ada", "Ben", "Cleo", "Dev", "Eva", "Finn", "Gia", "Hugo", "Ines", "Jon", "Kai", "Lena"]
    things = ["apples", "books", "coins", "shells", "stamps", "marbles", "pencils", "cards"]
    documents = []
    for _ in range(num_documents):
        giver, taker = rng.sample(names, 2)
        thing, had, given = rng.choice(things), rng.randint(1, 20), rng.randint(1, 20)
        documents.append(f"{taker} has {had} {thing}. {giver} gives {taker} {given} more {thing}. "
                         f"Now {taker} has {had + given} {thing}.")
    return documents


DATA_FILE_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_raw_dataset(name, subset):
    """A Hub dataset's or a local folder's train and validation splits (if any), or a local file's rows."""
    extension = os.path.splitext(name)[1]
    if os.path.isfile(name) and extension not in DATA_FILE_BUILDERS:
        sys.exit(f"error: cannot read {name!r}: use a {', '.join(DATA_FILE_BUILDERS)} file or a folder of them")
    with exit_on_error(f"cannot load dataset {name!r}", "pass a Hugging Face dataset id (and --dataset-subset if "
                       "it has several), or a local file or folder of text"):
        if os.path.isfile(name):
            return [datasets.load_dataset(DATA_FILE_BUILDERS[extension], data_files=name, split="train"), None]
        train = datasets.load_dataset(name, subset, split="train")
    try:
        return [train, datasets.load_dataset(name, subset, split="validation")]
    except ValueError:  # (datasets' answer for a split the dataset does not have)
        return [train, None]


def rng_state():
    cuda_state = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return {"cpu": torch.get_rng_state(), "cuda": cuda_state}


def set_rng_state(saved):
    torch.set_rng_state(saved["cpu"])
    if torch.cuda.is_available() and saved["cuda"] is not None:
        torch.cuda.set_rng_state(saved["cuda"])


def to_device(rows, device):
    # Only a copy from pinned (page-locked) memory overlaps the GPU's work: from ordinary memory it blocks the CPU.
    batch = torch.from_numpy(rows)
    return (batch.pin_memory() if device.type == "cuda" else batch).to(device, non_blocking=True)


def start_wandb(args, exp_dir):
    import wandb

    # id + resume="allow": a relaunch of the same experiment continues the same wandb run.
    return wandb.init(project="distributed-training-guide", name=args.experiment_name,
                      id=args.experiment_name, resume="allow", dir=exp_dir, config=vars(args))


def truncate_metrics(path, after_step):
    """After a resume, drop the lines that the interrupted run logged past its last checkpoint."""
    if os.path.exists(path):
        with open(path) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] <= after_step]
        with open(path, "w") as f:
            f.writelines(kept)


# Dense bf16 peaks from the datasheets (no sparsity). The first key in the GPU's name wins: GH200 before H200.
PEAK_BF16_FLOPS = [("GH200", 989e12), ("GB200", 2500e12), ("H200 NVL", 835e12), ("H200", 989e12),
                   ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("B200", 2250e12),
                   ("A100", 312e12), ("L40S", 362e12), ("A10G", 70e12)]


def peak_flops_per_second(device):
    """The GPU's dense bf16 peak, or None (CPU, or a GPU not in the table: no MFU rather than a guess)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def peak_memory_gb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # On CPU the process's peak resident memory is the honest number (ru_maxrss: KiB on Linux, bytes on macOS).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**30 if sys.platform == "darwin" else 2**20)


def log_metrics(path, metrics, progress):
    with open(path, "a") as f:
        f.write(json.dumps(metrics) + "\n")
    progress.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}")
    progress.write(" | ".join(f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()))


# --- Arguments and inputs: what argparse and the libraries would report late, or in a traceback ---


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse, with a mistake as one line (no usage block) that report_exit puts in torchrun's summary."""

    def error(self, message):
        sys.exit(f"error: {message} (--help lists the flags)")


def check_args(args):
    """What argparse cannot check alone: the launch, flags that need each other, the torch version."""
    if "LOCAL_RANK" not in os.environ:
        sys.exit("error: launch this script with torchrun, e.g. torchrun --nproc_per_node=2 train_llm.py")
    oldest, newest = TESTED_TORCH
    if torch.__version__ < oldest and os.environ.get("RANK", "0") == "0":  # (rank 0 alone: one line)
        print(f"warning: torch {torch.__version__} is older than the releases these scripts are tested on "
              f"({oldest} to {newest}); if a step fails, install torch {oldest} or newer", file=sys.stderr)
    if args.from_pretrained and args.model_name is None:
        sys.exit("error: --from-pretrained needs -m/--model-name (the default tiny model has no weights)")
    check_save_dir(args.save_dir, args.experiment_name)


def check_save_dir(save_dir, experiment_name):
    """The experiment's folder (or the nearest existing one above it) must take a file, tried before any write."""
    existing = os.path.abspath(os.path.join(save_dir, experiment_name))
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    with exit_on_error(f"cannot write to --save-dir {save_dir!r}", "pass a writable folder", (OSError,)):
        tempfile.TemporaryFile(dir=existing, prefix="write-test-").close()  # (the name in the error line)


def checked_number(convert, is_valid, what):
    """An argparse type: the number in the text, if valid (NaN is valid nowhere: every comparison is False)."""
    def number(text):
        if not is_valid(value := convert(text)):
            raise argparse.ArgumentTypeError(f"{text} is not {what}")
        return value
    return number


positive_int = checked_number(int, lambda value: value >= 1, "a positive integer")
non_negative_int = checked_number(int, lambda value: value >= 0, "zero or a positive integer")
fraction = checked_number(float, lambda value: 0 <= value < 1, "a fraction from 0 to below 1")
positive_float = checked_number(float, lambda value: 0 < value < math.inf, "a positive number")


def path_or_hub_id(name):
    """-m and -d: a path that exists, or a Hub id for the libraries to look up. A name that can only be a path
    (/ . or ~ first, a data file, more folders than owner/name) fails here, not after the Hub's retries."""
    path = os.path.expanduser(name)
    if os.path.exists(path):
        return path
    if name.startswith(("/", ".", "~")) or os.path.splitext(name)[1] in DATA_FILE_BUILDERS or name.count("/") > 1:
        raise argparse.ArgumentTypeError(f"no such file or folder: {name!r}")
    return name


# The oldest and the newest torch release that CI trains every chapter on (.ci/run).
TESTED_TORCH = ("2.11", "2.15")


def make_experiment_dir(save_dir, experiment_name):
    exp_dir = os.path.join(save_dir, experiment_name)
    os.makedirs(exp_dir, exist_ok=True)
    return exp_dir


@contextmanager
def exit_on_error(what, fix, errors=(Exception,)):
    """An error in the block becomes one line: what failed, the library's reason, and what to do."""
    try:
        yield
    except errors as error:
        sys.exit(f"error: {what} ({one_line(error)}); {fix}")


def exit_on_build_error(args):
    return exit_on_error(f"cannot build model {args.model_name or 'tiny-llama'!r}", "pass a model whose files are "
                         "there (its weights, with --from-pretrained) and an --attn-implementation it supports",
                         (ImportError, ValueError, OSError))


def one_line(error):
    """The error's message and its cause's (datasets' reason) in one line of at most 300 characters."""
    message = f"{error}: {error.__cause__}" if error.__cause__ else str(error)
    return textwrap.shorten(message, 300) or type(error).__name__


def check_model_fits_tokenizer(args, config, tokenizer):
    # NOTE: a token id past the embedding fails deep in the forward on CPU, and as a device-side assert on CUDA.
    vocab_size = getattr(config, "vocab_size", None)
    if vocab_size is not None and len(tokenizer) > vocab_size:
        sys.exit(f"error: the tokenizer of {args.model_name!r} has {len(tokenizer)} tokens, more than the model's "
                 f"{vocab_size} embeddings; pass a model whose tokenizer and config.json belong together")
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions is not None and args.seq_length > max_positions:
        sys.exit(f"error: -s/--seq-length {args.seq_length} is longer than the {max_positions} positions of "
                 f"{args.model_name or 'the tiny model'}; pass -s {max_positions} or less")


def check_text_column(raw, name):
    if "text" not in raw.column_names:
        sys.exit(f"error: dataset {name!r} has no 'text' column (it has {raw.column_names})")


def check_one_batch_fits(num_rows, global_batch_size, args):
    """The training rows (after the validation rows are held out) must make at least one global batch."""
    if num_rows < global_batch_size:
        parts = global_batch_size // args.batch_size
        split = f" ({parts} ranks and micro-batches of -b {args.batch_size})" if parts > 1 else ""
        sys.exit(f"error: the dataset gives {num_rows} training sequences of {args.seq_length + 1} tokens, fewer "
                 f"than one batch of {global_batch_size}{split}; use a smaller -b/--batch-size, "
                 "--grad-accum-steps or -s/--seq-length, or more data")


def fit_grad_accum_steps(args, data_parallel_size):
    """With --global-batch-size, the --grad-accum-steps that make it at -b on this many data-parallel ranks: a
    relaunch on another number of ranks (a node added or lost) then trains the same global batch."""
    if args.global_batch_size is None:
        return
    rows_per_micro_step = data_parallel_size * args.batch_size
    if args.global_batch_size % rows_per_micro_step:
        sys.exit(f"error: --global-batch-size {args.global_batch_size} is not a multiple of {data_parallel_size} "
                 f"data-parallel ranks x -b {args.batch_size} = {rows_per_micro_step}; pass a -b (or a number of "
                 "ranks) whose product divides it")
    args.grad_accum_steps = args.global_batch_size // rows_per_micro_step


def warn_if_mostly_warmup(warmup_steps, total_steps):
    if warmup_steps > total_steps // 2 and os.environ.get("RANK", "0") == "0":
        print(f"warning: --warmup-steps {warmup_steps} covers most of the {total_steps} steps, so the learning "
              f"rate hardly decays; pass --warmup-steps {max(1, total_steps // 20)} or train longer",
              file=sys.stderr)


def exit_if_diverged(step, loss, grad_norm):
    """A NaN or infinite loss or gradient norm makes the weights NaN from here on: stop before a checkpoint."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        sys.exit(f"error: training diverged at step {step} (loss {loss:.4g}, gradient norm {grad_norm:.4g}) and "
                 "no checkpoint holds it; train again with a lower --lr under a new -e (this experiment resumes "
                 "with its own --lr and diverges again)")


def start_profiler(exp_dir, start_step, total_steps):
    """--profile: steps start_step + 3 and + 4 of this launch (after one to wait, one to warm up) as one Chrome
    trace per rank in <experiment>/profile/ (open it in https://ui.perfetto.dev): ops, kernels, collectives."""
    rank, steps = int(os.environ.get("RANK", "0")), f"steps {start_step + 3}-{start_step + 4}"
    if start_step + 4 > total_steps:
        return print(f"warning: --profile records {steps} of this launch, which ends at step {total_steps}: "
                     "nothing is profiled; launch with 4 or more steps to go")

    def write_trace(profiler):
        # (called after the 4th step, or by stop() when a signal ended the launch before: then nothing is whole)
        if profiler.step_num < 4:
            return print(f"rank {rank}: the launch stopped before the end of {steps}: nothing profiled")
        path = os.path.join(exp_dir, "profile", f"rank-{rank}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        profiler.export_chrome_trace(path)
        print(f"rank {rank}: {steps} profiled (their tokens_per_s includes the profiler's cost): {path}")

    profiler = torch.profiler.profile(on_trace_ready=write_trace, record_shapes=True,
                                      schedule=torch.profiler.schedule(wait=1, warmup=1, active=2, repeat=1))
    profiler.start()
    return profiler


# --- Signals: a scheduler's warning or Ctrl-C ends the run after a step, with a checkpoint ---


def stop_on_signals():
    """A list that SIGTERM and SIGUSR1 (what schedulers send before they kill a job) and SIGINT (Ctrl-C) append
    to: the training loop stops after the step it is in, with a checkpoint."""
    stop_signals = []
    for stop_signal in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(stop_signal, lambda signum, frame: request_stop(stop_signals, signum))
    # torchrun starts workers in sessions of their own: if it is killed (kill -9, the OOM killer), the kernel
    # sends us SIGTERM (PR_SET_PDEATHSIG = 1) and we stop with a checkpoint instead of training on as orphans.
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)
    return stop_signals


def request_stop(stop_signals, signum):
    # NOTE: a handler may run again while it runs (two signals in a row): taking a lock here, as
    # threading.Event.set does, can deadlock. Appending to a list takes none.
    stop_signals.append(signum)
    # A second Ctrl-C ends the process at once, without waiting for the step and the checkpoint.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# --- Errors that reach every rank: one rank's failure must not leave the others waiting in a collective ---


@contextmanager
def stop_all_ranks_if_one_fails():
    """Every rank must enter this (an all-gather as the block ends): if the block fails on one rank (an error
    line, a full disk, any exception), every rank stops with its line instead of waiting in the next collective."""
    failure, line = None, None
    try:
        yield
    except BaseException as error:  # not only Exception: SystemExit is a check's line, DCP's errors are Base
        failure = error
        line = str(error.code) if isinstance(error, SystemExit) else full_disk_message(error) or (
            f"error: rank {dist.get_rank()} stopped with {type(error).__name__}: {one_line(error)} (its "
            "traceback is in its output)")
    lines = [None] * dist.get_world_size()
    dist.all_gather_object(lines, line)
    if failure is not None:
        raise failure
    if any(lines):
        sys.exit(next(filter(None, lines)))


@contextmanager
def rank_0_first():
    """Every rank must enter this (stop_all_ranks_if_one_fails inside): rank 0 runs the block first, the other
    ranks once it has succeeded there (rank 0 fills a cache that they then read)."""
    with stop_all_ranks_if_one_fails():
        if dist.get_rank() == 0:
            yield
    if dist.get_rank() != 0:
        yield


# --- Checkpoints that are complete or ignored: a .partial folder, an atomic rename, a fallback on resume ---


def load_newest_checkpoint(exp_dir, load, fresh_state):
    """Every rank must call this (from chapter 02 on, collectives inside): (folder, load(folder)) for the newest
    complete checkpoint that loads on every rank, else (None, fresh_state). One that fails to load (a file cut
    short) is renamed step-N.damaged and the one before loads (replacing all the state the failed one touched)."""
    checkpoints_dir = os.path.join(exp_dir, "checkpoints")
    # Rank 0 lists the folder for all: every rank must try the same checkpoints, in the same order.
    names = [complete_checkpoints(checkpoints_dir)]
    dist.broadcast_object_list(names, src=0)
    for name in reversed(names[0]):
        checkpoint_dir = os.path.join(checkpoints_dir, name)
        try:
            loaded, failure = load(checkpoint_dir), None
        except BaseException as error:  # not only Exception: DCP raises a CheckpointException
            loaded, failure = None, damaged_file_error(error)
            if failure is None:  # a check's line (another model, other flags), a bug, no memory: not damage
                raise
        failures = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
        if not any(failures):
            return checkpoint_dir, loaded
        with stop_all_ranks_if_one_fails():
            if dist.get_rank() == 0:
                os.rename(checkpoint_dir, checkpoint_dir + ".damaged")
                print(f"warning: checkpoint {checkpoint_dir} fails to load ({next(filter(None, failures))}); set "
                      f"it aside as {name}.damaged", file=sys.stderr)
    if names[0]:
        sys.exit(f"error: no checkpoint in {checkpoints_dir} loads (each is now *.damaged); move them away to "
                 "start fresh, or pass a new -e/--experiment-name")
    return None, fresh_state


def damaged_file_error(error):
    """What a load failed on (at most 200 characters) if a damaged file explains it: one missing or cut short
    (OSError, EOFError, json's ValueError, torch.load's RuntimeError); else None."""
    failures = getattr(error, "failures", None)  # DCP's CheckpointException: {rank: (exception, traceback)}
    if isinstance(failures, dict) and failures:
        error = next(iter(failures.values()))[0]
    damage = (OSError, EOFError, ValueError, RuntimeError)
    if isinstance(error, damage) and not isinstance(error, torch.OutOfMemoryError):
        return textwrap.shorten(f"{type(error).__name__}: {error}", 200).removesuffix(":")


def complete_checkpoints(checkpoints_dir):
    """The names of the complete checkpoints (step-N, not step-N.partial or step-N.damaged), oldest first."""
    names = os.listdir(checkpoints_dir) if os.path.isdir(checkpoints_dir) else []
    return sorted(name for name in names if name.startswith("step-") and "." not in name)


@contextmanager
def checkpoint_folder(exp_dir, state, param_shapes, checkpoint_format):
    """Every rank must enter this (from chapter 02 on, collectives inside): the folder step-N.partial that the
    block writes the checkpoint into, renamed to step-N (atomic) once the block has returned on every rank."""
    partial_dir = start_checkpoint_folder(exp_dir, state, param_shapes, checkpoint_format)
    with stop_all_ranks_if_one_fails():
        yield partial_dir
    with stop_all_ranks_if_one_fails():
        if dist.get_rank() == 0:
            complete_checkpoint_folder(partial_dir)


def start_checkpoint_folder(exp_dir, state, param_shapes, checkpoint_format):
    """Every rank must call this (from chapter 02 on, a collective inside): rank 0 makes step-N.partial."""
    partial_dir = os.path.join(exp_dir, "checkpoints", f"step-{state.step:08d}.partial")
    with stop_all_ranks_if_one_fails():
        if dist.get_rank() == 0:
            shutil.rmtree(partial_dir, ignore_errors=True)
            os.makedirs(partial_dir)
            with open(os.path.join(partial_dir, "state.json"), "w") as f:
                json.dump({**vars(state), "param_shapes": param_shapes, "checkpoint_format": checkpoint_format}, f)
    return partial_dir


def complete_checkpoint_folder(partial_dir, keep=2):
    """Rank 0 alone, once every rank has written its part: step-N.partial -> step-N (atomic); then it keeps the
    newest `keep` complete checkpoints (the fallback if the newest is damaged) and *.damaged ones."""
    os.rename(partial_dir, partial_dir.removesuffix(".partial"))
    checkpoints_dir = os.path.dirname(partial_dir)
    stale = [name for name in os.listdir(checkpoints_dir) if name.endswith(".partial")]
    for name in complete_checkpoints(checkpoints_dir)[:-keep] + stale:
        shutil.rmtree(os.path.join(checkpoints_dir, name), ignore_errors=True)


def torch_save(obj, path):
    # Into a file object, not a path: a full disk then surfaces as its OSError, not as "unexpected pos".
    with open(path, "wb") as f:
        torch.save(obj, f)


def read_checkpoint_state(checkpoint_dir, param_shapes, fixed_flags, checkpoint_format):
    """The state.json of a checkpoint, if this run can continue it (same format, model and fixed flags)."""
    with open(os.path.join(checkpoint_dir, "state.json")) as f:
        state = json.load(f)
    written_as, saved_shapes = state.pop("checkpoint_format", "an older script's"), state.pop("param_shapes")
    if written_as != checkpoint_format:
        problem = (f"is {written_as}, this script's are {checkpoint_format}; resume it with the script that "
                   "wrote it")
    elif saved_shapes != param_shapes:
        problem = (f"holds a different model ({describe_mismatch(saved_shapes, param_shapes)}); pass the -m it "
                   "was trained with")
    # NOTE: on other rows (-s, -d) or in another order (--seed) the saved position would skip or repeat data,
    # and the saved schedule would silently keep the old --lr.
    elif state["fixed_flags"] != fixed_flags:
        problem = (f"continues only under the flags it was trained with "
                   f"({describe_mismatch(state['fixed_flags'], fixed_flags)}); relaunch with those")
    else:
        return state
    sys.exit(f"error: checkpoint {checkpoint_dir} {problem}, or pass a new -e/--experiment-name to start fresh")


def describe_mismatch(saved, current):
    """The first entry (a parameter's shape, a fixed flag) that differs, as it is in the checkpoint and now."""
    name = next(name for name in sorted(set(saved) | set(current)) if saved.get(name) != current.get(name))
    return f"{name}: {saved.get(name)} in the checkpoint, {current.get(name)} now"


def check_resume_step(step, total_steps, checkpoint_dir):
    """A relaunch must have steps left to train, else it would end with status 0 having done nothing. A run that
    saved its last step but was stopped before its export (no hf/ folder yet) resumes just to export."""
    hf_dir = os.path.join(os.path.dirname(os.path.dirname(checkpoint_dir)), "hf")  # <exp>/checkpoints/step-N
    finished = step == total_steps and os.path.isdir(hf_dir)
    if finished or step > total_steps:
        problem = (f"the last of this run, which has finished (its model is in {hf_dir})" if finished else
                   f"past the last step of this run ({total_steps})")
        sys.exit(f"error: checkpoint {checkpoint_dir} is at step {step}, {problem}; pass a larger --max-steps or "
                 "--num-epochs to train on, or a new -e/--experiment-name for a new run")


# --- The exit: one line for every error we can name, and no teardown that can hang or crash ---


def full_disk_message(error):
    """The line that a full disk (or quota) behind error stops every rank with, else None: torch.save reports it
    as "unexpected pos" with the OSError as its context, DCP in a CheckpointException of every rank's errors."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"error: the disk is full ({one_line(error)}); free space under --save-dir or pass another, then "
                "relaunch the same command (the last complete checkpoint is intact)")
    causes = [error.__cause__, error.__context__]
    failures = getattr(error, "failures", None)  # DCP's CheckpointException: {rank: (exception, traceback)}
    if isinstance(failures, dict):
        causes += [failure[0] for failure in failures.values()]
    return next(filter(None, (full_disk_message(cause) for cause in causes if cause is not None)), None)


def report_exit(stop):
    """The exit code of sys.exit(code or "message"); a message is printed and written where torchrun's failure
    summary shows it (instead of "To enable traceback see ...")."""
    if not isinstance(stop.code, str):
        return stop.code or 0
    # One write with its newline: the lines of several ranks on one terminal then cannot interleave.
    sys.stderr.write(stop.code + "\n")
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        # The format of @record's error file, with the message where the traceback would be.
        extra_info = {"py_callstack": stop.code, "timestamp": str(int(time.time()))}
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            json.dump({"message": {"message": stop.code, "extraInfo": extra_info}}, f)
        # torchrun stops every rank (SIGTERM) as soon as one exits: a rank about to fail with the same line (one
        # still importing, say) would die before printing it, a "Signal 15" in the summary. So give them time.
        if stop.code.startswith("error:"):
            time.sleep(3)
    return 1


if __name__ == "__main__":
    # NOTE: every exit skips the interpreter's teardown (os._exit). From chapter 02 on, gloo's worker threads
    # can outlive the process group, and torn down with the interpreter they hang or abort a finished process
    # (pytorch/pytorch#56297, #190489). By now everything is written and closed.
    try:
        main()
        exit_code = 0
    except SystemExit as stop:
        exit_code = report_exit(stop)
    except BaseException as error:  # not only Exception: DCP raises a CheckpointException
        if full_disk_message(error) is None:
            traceback.print_exc()
        exit_code = report_exit(SystemExit(full_disk_message(error) or 1))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
