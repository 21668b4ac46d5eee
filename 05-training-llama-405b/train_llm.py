"""Train a model larger than one GPU, or one node's memory, with FSDP2: Llama 3.1 405B on 8 nodes x 8 GPUs.

    torchrun --nproc_per_node=2 train_llm.py              # tiny Llama, offline corpus, any laptop
    sbatch --nodes=8 job.sbatch -e llama-405b              # see README.md and ../12-choosing-a-layout first

Chapter 04's script plus what such a model needs: pretrained weights read from safetensors by every rank, each
only the slices it owns (no process ever holds the whole model), activation checkpointing, explicit prefetch,
a process-group timeout long enough for the load, and checkpoints written while training goes on.
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
import warnings
from dataclasses import dataclass
from contextlib import contextmanager
from datetime import timedelta

import datasets
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.utils.checkpoint import checkpoint
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
    # nccl moves CUDA tensors between GPUs; gloo moves CPU tensors. device_id binds nccl to our GPU at once.
    # NOTE: a collective waits this long for a slow rank before it fails the job (NCCL: 10 minutes). At 405B
    # ranks meet again only after the load, and a rank whose files come from a busy shared filesystem can be
    # many minutes behind the others: see README.md.
    backend = process_group_backend(device, args.cpu_offload)
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None,
                            timeout=timedelta(minutes=args.timeout_minutes))
    mesh = make_device_mesh(device, world_size, args.replicate_degree)
    # Weights and optimizer state stay fp32 (the "master" copy); only the forward/backward math runs in --dtype.
    # Pure bf16 weights lose small updates: at lr 3e-5 most bf16 weights would never change.
    compute_dtype = getattr(torch, args.dtype or default_compute_dtype(device))
    torch.manual_seed(args.seed)

    config, tokenizer = load_config_and_tokenizer(args)
    model = build_model(args, config, device, mesh, compute_dtype)
    param_shapes = {name: list(p.shape) for name, p in model.named_parameters()}
    flops_per_token = training_flops_per_token(model, config, args.seq_length)
    if rank == 0:
        print(f"model: {model.num_parameters() / 1e6:.1f}M parameters, compute in {compute_dtype}")

    # Rank 0 fills the datasets cache first; the others then read it instead of racing to write it.
    if rank != 0:
        datasets.disable_progress_bars()
    with rank_0_first():
        data, val_data = load_and_pack(args, tokenizer)
    # A step trains on the global batch: on each rank --grad-accum-steps micro-batches of -b rows, a backward
    # each, their gradients added up before the optimizer step (a batch that does not fit the device at once).
    fit_grad_accum_steps(args, world_size)
    rows_per_rank = args.batch_size * args.grad_accum_steps
    global_batch_size = rows_per_rank * world_size
    tokens_per_step = global_batch_size * args.seq_length
    data, val_data = hold_out_validation(data, val_data, global_batch_size, args)
    check_one_batch_fits(len(data), global_batch_size, args)
    if rank == 0:
        print(f"global batch: {global_batch_size} sequences ({world_size} ranks x -b {args.batch_size} x "
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

    # Compile AFTER sharding: the all-gathers and reduce-scatters run in FSDP's hooks around each block.
    if args.compile:
        model.compile()
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
    async_checkpoints = AsyncCheckpoints(device) if args.async_checkpoint else None  # written while training
    model.train()

    while state.step < total_steps:
        rows = next_global_batch(data, state, global_batch_size, args.seed)
        # The step's loss is the mean over all label tokens of the global batch, as one pass over it would give:
        # each micro-batch's summed loss over that count (a micro-batch of rows with masked prompts has fewer
        # label tokens and must weigh less). Every rank reads all the batch's rows and counts them: no all-reduce.
        num_label_tokens = count_label_tokens(rows)
        # Each rank takes its slice of the global batch: N ranks at -b b see what one process sees at -b N*b.
        rows = {key: value[rank * rows_per_rank : (rank + 1) * rows_per_rank] for key, value in rows.items()}
        input_ids, labels = inputs_and_labels(rows, device)
        # FSDP reduce-scatters each micro-batch's gradients in its backward, and the shards add them up: waiting
        # for the last micro-batch would keep whole (unsharded) gradients on every rank, what FSDP saves.
        for micro_input_ids, micro_labels in zip(input_ids.split(args.batch_size), labels.split(args.batch_size)):
            # No autocast: MixedPrecisionPolicy hands each block its weights in --dtype (as torchtitan does).
            logits = model(input_ids=micro_input_ids, use_cache=False).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), micro_labels.flatten(0, 1), reduction="sum")
            # x world_size: FSDP averages the ranks' gradients, and the log line averages their losses.
            loss = loss * world_size / num_label_tokens
            loss.backward()
            # NOTE: nothing in a step reads a value back from the GPU (.item(), printing a tensor): the CPU queues
            # the next step while the GPU computes this one. Losses are summed on the device until a log step.
            running_loss += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
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
                metrics["val_loss"] = evaluate(model, val_data, args, device)
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

        if async_checkpoints is not None:
            async_checkpoints.complete_if_written()
        if stop or checkpoint_now:
            # Each rank holds different shards, so every rank writes its own part of the checkpoint.
            save_checkpoint(exp_dir, state, param_shapes, model, optimizer, lr_schedule, async_checkpoints)
        if profiler is not None:
            profiler.step()
        if stop:
            break

    progress.close()
    if profiler is not None:
        profiler.stop()
    if async_checkpoints is not None:
        async_checkpoints.close()  # the last checkpoint is complete before the export and the exit
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


def process_group_backend(device, cpu_offload):
    """nccl moves CUDA tensors between GPUs, gloo CPU tensors."""
    if device.type != "cuda":
        return "gloo"
    # NOTE: with --cpu-offload the weights and gradients are CPU tensors, and the gradient norm is all-reduced
    # among them: nccl has no CPU path ("No backend type associated with device type cpu"), gloo takes those.
    return "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"


def make_device_mesh(device, world_size, replicate_degree):
    """The ranks as a grid; FSDP shards every weight over "shard". HSDP (--replicate-degree R) keeps R copies,
    each sharded over WORLD_SIZE / R ranks (a node): all-gathers stay in a node, only gradients cross nodes."""
    if world_size % replicate_degree:
        sys.exit(
            f"error: --replicate-degree {replicate_degree} does not divide the {world_size} ranks; "
            "pass a divisor of the number of ranks, such as the number of nodes"
        )
    if replicate_degree == 1:
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(
        device.type, (replicate_degree, world_size // replicate_degree), mesh_dim_names=("replicate", "shard")
    )


def build_model(args, config, device, mesh, compute_dtype):
    # On the meta device tensors have shapes but no storage: building even a 70B model here allocates nothing.
    # Each rank allocates only its own shards, after sharding.
    with exit_on_build_error(args), torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=args.attn_implementation
        )
    if args.activation_checkpointing:
        # Full checkpointing of every block: backward reruns the block's forward from its saved input. Each
        # block then keeps one hidden_size vector per token instead of dozens (see README.md for why not
        # selective). The wrapper goes on forward, not around the module, so the weights keep their names
        # (checkpoints, export) and FSDP's hooks stay outside: backward recomputes with the gathered weights.
        for block in transformer_blocks(model):
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    shard_model(model, mesh, compute_dtype, args.cpu_offload, args.reshard_after_forward, device,
                args.explicit_prefetch)
    # to_empty gives each rank uninitialised storage for its shards and buffers (in CPU memory with --cpu-offload).
    model.to_empty(device="cpu" if args.cpu_offload else device)
    initialize_weights(model, mesh, args.seed)
    if args.cpu_offload:
        # Offloading keeps parameters in CPU memory between uses, and buffers there for good: RoPE's inv_freq
        # would be copied to the GPU in every forward, and a buffer such as Gemma's embed_scale meet GPU tensors.
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, buffer.to(device))
    if args.from_pretrained:
        load_pretrained_weights(model, args.model_name)
    return model


def shard_model(model, mesh, compute_dtype, cpu_offload, reshard_after_forward, device, explicit_prefetch):
    """fully_shard each transformer block, the embedding and the output head, then the root: one group per call,
    all-gathered just before it runs, freed just after, its gradients reduce-scattered as soon as complete."""
    # The fp32 shards are the master weights. param_dtype=bf16 casts them before the all-gather (half the bytes
    # to send, compute in bf16); reduce_dtype=fp32 sums gradients in fp32 so small ones are not lost.
    fsdp_options = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32),
        # Pinned (page-locked) CPU memory speeds up copies to the GPU; without CUDA it cannot be allocated.
        offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy(),
    )
    blocks = transformer_blocks(model)
    # --reshard-after-forward true frees a block's gathered weights after its forward and gathers them again for
    # its backward (ZeRO-3); false keeps them from forward to backward: one all-gather a step instead of two,
    # for a whole model's weights held at the turn (ZeRO-2's traffic); N keeps them sharded over N ranks (a node).
    with exit_on_error(f"cannot reshard to {reshard_after_forward} ranks after forward",
                       "pass --reshard-after-forward true, false, or a divisor of the ranks that shard a weight",
                       ValueError):
        for block in blocks:
            fully_shard(block, **fsdp_options, reshard_after_forward=reshard_after_forward)
    if explicit_prefetch:
        # In forward FSDP2 issues block i+1's all-gather only when block i+1 starts; naming the next block here
        # starts it while block i computes, so the network and the GPU overlap, for one more gathered block in
        # forward. (Backward prefetches a block by default: the peak of a step is the same, chapter 12 measures.)
        for block, next_block in zip(blocks, blocks[1:]):
            block.set_modules_to_forward_prefetch([next_block])
            next_block.set_modules_to_backward_prefetch([block])
    # The embedding and the head (0.5B parameters apiece in Llama 3 8B) as groups of their own are freed after
    # use, not held all step by the root. Backward needs the head again at once: it stays gathered after forward.
    # A tied pair is one weight, which must stay in one group: the root's.
    if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        fully_shard(model.get_input_embeddings(), **fsdp_options, reshard_after_forward=reshard_after_forward)
        fully_shard(model.get_output_embeddings(), **fsdp_options, reshard_after_forward=False)
    # The root's group takes every weight no other group holds: the final norm, and a tied embedding.
    fully_shard(model, **fsdp_options)


def transformer_blocks(model):
    """The repeated layers, found by the class names Hugging Face never splits across devices
    (`_no_split_modules`: LlamaDecoderLayer, Qwen2DecoderLayer, MistralDecoderLayer, ...)."""
    block_classes = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [module for module in model.modules() if type(module).__name__ in block_classes]
    if not blocks:
        sys.exit(
            f"error: cannot find the transformer blocks of {type(model).__name__} to shard (its "
            "_no_split_modules names none); use a decoder model such as Llama, Qwen, Mistral or Gemma"
        )
    return blocks


def initialize_weights(model, mesh, seed):
    """Fill this rank's shards as from_config fills a whole model: Hugging Face's init (the distributions of
    chapter 01, e.g. normal(0, 0.02) weights and ones in the norms), and the buffers that no checkpoint holds."""
    # NOTE: RoPE's inv_freq is a non-persistent buffer: in no state dict, and garbage after to_empty. Training
    # would run without error, but wrong. HF's init recomputes it from the config.
    # On CPU each rank draws from its own generator (on CUDA, DTensor offsets one shared stream): seeding it by
    # shard index makes the shards differ and HSDP replicas agree.
    torch.default_generator.manual_seed(seed + mesh.get_local_rank("shard"))
    # HF zeroes the padding row through weight[padding_idx], which regathers a sharded weight (on gloo with a
    # warning on every rank, torch 2.14 on) into a temporary copy: hide padding_idx from it, zero the row below.
    padded = {module: module.padding_idx for module in model.modules()
              if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None}
    for module in padded:
        module.padding_idx = None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        model.initialize_weights()
    # Back to one random stream on every rank, as in chapter 02, so rank 0's saved RNG state is every rank's.
    torch.manual_seed(seed)
    # The padding row, in the shard that holds it (fully_shard splits dim 0 like torch.chunk).
    for module, padding_idx in padded.items():
        module.padding_idx = padding_idx
        local_rows = module.weight.to_local()
        first_row = mesh.get_local_rank("shard") * math.ceil(module.num_embeddings / mesh["shard"].size())
        if 0 <= padding_idx - first_row < local_rows.shape[0]:
            with torch.no_grad():
                local_rows[padding_idx - first_row].zero_()


def load_pretrained_weights(model, model_name):
    """Every rank reads, from the safetensors files of a local folder, only the rows of each weight that its
    shard holds, one tensor at a time: no process ever holds more than its shards plus one tensor's rows."""
    files = sorted(name for name in os.listdir(model_name) if name.endswith(".safetensors")) \
        if os.path.isdir(model_name) else []
    if not files:
        sys.exit(
            f"error: --from-pretrained reads safetensors files from a local folder, and {model_name!r} is not "
            "one that holds them; download the model first with download_model.py (every rank then reads the "
            "same files)"
        )
    # Each file starts with a header naming its tensors, their shapes and offsets: reading it reads no weights.
    file_of, shape_of = {}, {}
    for file in files:
        with safe_open(os.path.join(model_name, file), framework="pt") as f:
            for name in f.keys():
                file_of[name], shape_of[name] = file, f.get_slice(name).get_shape()
    # A tied output head is the embedding's parameter: named_parameters lists it once, under the embedding.
    params = dict(model.named_parameters())
    for name, param in params.items():
        if name not in file_of:
            sys.exit(
                f"error: {model_name!r} has no tensor {name}: its files belong to another config, or transformers "
                "renames or fuses them while loading (mixture-of-experts models), which only chapter 04 reads"
            )
        if list(shape_of[name]) != list(param.shape):
            sys.exit(
                f"error: {name} is {list(shape_of[name])} in {model_name!r} and {list(param.shape)} in its "
                "config.json; the weights and the config are of different models"
            )
    for name, param in params.items():
        # fully_shard splits dim 0 like torch.chunk: shard r holds rows [r * ceil(n/N), ...) of the full weight.
        local, mesh = param.to_local(), param.device_mesh
        rows_per_shard = math.ceil(param.shape[0] / mesh["shard"].size())
        start = min(param.shape[0], mesh.get_local_rank("shard") * rows_per_shard)
        with safe_open(os.path.join(model_name, file_of[name]), framework="pt") as f:
            rows = f.get_slice(name)[start : start + local.shape[0]]
        with torch.no_grad():
            # copy_ converts the file's dtype (bf16 for Llama 3.1) to the fp32 master weights, on their device.
            local.copy_(rows)
        del rows  # before the next tensor's rows are read


def save_checkpoint(exp_dir, state, param_shapes, model, optimizer, lr_schedule, async_checkpoints=None):
    if async_checkpoints is not None:
        return async_checkpoints.save(exp_dir, state, param_shapes, model, optimizer, lr_schedule)
    with checkpoint_folder(exp_dir, state, param_shapes, "sharded (DCP)") as folder:
        # get_state_dict names shards by parameter name and offsets: a checkpoint of N ranks loads into any number.
        # dcp.save writes a file per rank, then rank 0 the index (.metadata); every node must see the folder.
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)
        save_training_state(folder, lr_schedule)


def save_training_state(folder, lr_schedule):
    # The data order has its own generator; the RNG states cover anything random in the model (dropout).
    training_state = {"lr_schedule": lr_schedule.state_dict(), "rng": rng_state()}
    if dist.get_rank() == 0:
        torch_save(training_state, os.path.join(folder, "checkpoint.pt"))


class AsyncCheckpoints:
    """--async-checkpoint: dcp.async_save copies this rank's state to host memory (the step waits only for that)
    and writes it from a thread while training goes on. At most one write is in flight: the next save, a stop
    and the end wait for it. Its step-N.partial becomes step-N once every rank's write has ended."""

    def __init__(self, device):
        # Every rank must create this (new_group is a collective). The writing thread's collectives get a gloo
        # group of their own: on training's group, two threads' collectives could pair up differently on each rank.
        self.group = dist.new_group(backend="gloo")
        # One staging copy for the run, reused by every save; on a GPU pinned (page-locked), fastest to copy to.
        # NOTE: torch before 2.13 frees a stager after one save (the next fails: KeyError: <class 'type'>); there
        # async_save stages into a new, unpinned copy each save (stager None).
        options = StagingOptions(use_pinned_memory=device.type == "cuda", use_shared_memory=False,
                                 use_async_staging=False, use_non_blocking_copy=False)
        self.stager = DefaultStager(options) if torch.__version__ >= "2.13" else None
        self.write, self.partial_dir = None, None

    def save(self, exp_dir, state, param_shapes, model, optimizer, lr_schedule):
        """Every rank must call this (collectives inside): start writing step-N in the background."""
        self.wait()  # first: completing the write in flight removes every other step-N.partial
        self.partial_dir = start_checkpoint_folder(exp_dir, state, param_shapes, "sharded (DCP)")
        with stop_all_ranks_if_one_fails():
            model_state, optimizer_state = get_state_dict(model, optimizer)
            self.write = dcp.async_save({"model": model_state, "optimizer": optimizer_state},
                                        checkpoint_id=self.partial_dir, process_group=self.group,
                                        async_stager=self.stager)
            save_training_state(self.partial_dir, lr_schedule)

    def complete_if_written(self):
        """Rank 0 at each step, no collective: DCP's rank 0 writes the checkpoint's index (.metadata) after every
        rank's write has returned, so once its own write has ended, the checkpoint is whole."""
        if dist.get_rank() == 0 and self.partial_dir and self.write.done() and self.write.exception() is None:
            complete_checkpoint_folder(self.partial_dir)
            self.partial_dir = None

    def wait(self):
        """Every rank must call this (collectives inside): the write in flight ends and its folder is complete,
        or every rank stops with the line of the rank whose write failed (a full disk)."""
        if self.write is not None:
            with stop_all_ranks_if_one_fails():
                self.write.result()
                self.complete_if_written()
            self.write = None

    def close(self):
        """Every rank must call this (collectives inside): wait for the last write, free the staging copy."""
        self.wait()
        if self.stager is not None:
            self.stager.close()


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
def evaluate(model, val_data, args, device):
    """The mean loss over every label token of the validation rows, in eval mode (no dropout): each rank
    computes its slice of the rows, one all-reduce sums the slices' losses."""
    model.eval()
    rows_per_rank = len(val_data) // dist.get_world_size()
    first_row = dist.get_rank() * rows_per_rank
    loss_sum = torch.zeros((), device=device)
    for start in range(first_row, first_row + rows_per_rank, args.batch_size):
        input_ids, labels = inputs_and_labels(val_data[start : start + args.batch_size], device)
        logits = model(input_ids=input_ids, use_cache=False).logits
        loss_sum += F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")
    dist.all_reduce(loss_sum)
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
    parser.add_argument("--cpu-offload", action="store_true",
                        help="keep the sharded weights, gradients and optimizer state in CPU memory")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="keep only each block's input for backward and recompute the rest there")
    parser.add_argument("--explicit-prefetch", action="store_true",
                        help="all-gather the next block's weights while this one computes")
    parser.add_argument("--timeout-minutes", type=positive_int, default=60,
                        help="how long a collective waits for the slowest rank (the load) before failing")
    parser.add_argument("--replicate-degree", type=positive_int, default=1,
                        help="HSDP: shard within groups of WORLD_SIZE/R ranks (a node, say), replicate across R")
    parser.add_argument("--reshard-after-forward", type=true_false_or_int, default=True,
                        help="true: free gathered weights after forward (ZeRO-3); false: keep them for backward; "
                             "N: keep them sharded over N ranks")
    parser.add_argument("--async-checkpoint", action="store_true",
                        help="write checkpoints from a thread while training goes on (a host copy of each rank's "
                             "state: see README.md)")
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
    return parser


def true_false_or_int(text):
    choices = {"true": True, "false": False}
    return choices[text.lower()] if text.lower() in choices else int(text)


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
