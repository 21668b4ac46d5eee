"""Train a causal language model on many devices with fully sharded data parallel (FSDP2, fully_shard).

    torchrun --nproc_per_node=2 train_llm.py              # tiny Llama, offline corpus, any laptop
    torchrun --nproc_per_node=8 train_llm.py -m meta-llama/Llama-3.1-8B -d roneneldan/TinyStories --lr 3e-4

Chapter 02's script with DDP replaced by FSDP2: each rank keeps 1/N of the weights, gradients and optimizer
state, the model is built on the meta device and materialised shard by shard, and every rank writes its own
part of each checkpoint.
"""
import argparse
import json
import math
import os
import random
import shutil
import signal
import sys
import threading
import time
import warnings
from contextlib import nullcontext

import datasets
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import transformers
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from tqdm import tqdm


# NOTE: @record writes this rank's traceback where torchrun reports which rank failed and why.
@record
def main():
    args = get_parser().parse_args()

    if "LOCAL_RANK" not in os.environ:
        sys.exit("error: launch this script with torchrun, e.g. torchrun --nproc_per_node=2 train_llm.py")
    # NOTE: torchrun sets these for each process it starts. LOCAL_RANK numbers the processes on this node, and
    # it, not rank % device_count, picks the GPU: nodes may differ in how many processes they run.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # NOTE: nccl moves CUDA tensors between GPUs; gloo moves CPU tensors. device_id binds nccl to our GPU at once.
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None
    )
    mesh = make_device_mesh(device, world_size, args.replicate_degree)
    # NOTE: weights and optimizer state stay fp32 (the "master" copy); only the forward/backward math runs in
    # --dtype. Pure bf16 weights lose small updates: at lr 3e-5 most bf16 weights would never change.
    compute_dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    exp_dir = make_experiment_dir(args.save_dir, args.experiment_name)
    torch.manual_seed(args.seed)

    config, tokenizer = load_config_and_tokenizer(args)
    model = build_model(args, config, device, mesh, compute_dtype)
    param_shapes = {name: list(p.shape) for name, p in model.named_parameters()}
    flops_per_token = training_flops_per_token(model, config, args.seq_length)
    if rank == 0:
        print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, compute in {compute_dtype}")

    # NOTE: rank 0 tokenizes first and fills the datasets cache; the others then read that cache instead of all
    # racing to write it.
    if rank != 0:
        dist.barrier()
    data = load_and_pack(args, tokenizer)
    if rank == 0:
        dist.barrier()
    global_batch_size = args.batch_size * world_size
    tokens_per_step = global_batch_size * args.seq_length
    steps_per_epoch = len(data) // global_batch_size
    if steps_per_epoch == 0:
        sys.exit(
            f"error: the dataset gives {len(data)} sequences of {args.seq_length + 1} tokens, fewer than one batch "
            f"of {global_batch_size} ({world_size} ranks x -b {args.batch_size}); use a smaller -b/--batch-size "
            "or -s/--seq-length, or more data"
        )
    total_steps = steps_per_epoch * args.num_epochs
    if args.max_steps is not None:
        total_steps = min(total_steps, args.max_steps)

    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda"
    )
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_then_cosine(step, args.warmup_steps, total_steps)
    )

    # NOTE: the data position is (epoch, samples consumed in that epoch). The order of an epoch is a pure
    # function of (seed, epoch), so resuming needs no replay of skipped batches.
    state = {"step": 0, "epoch": 0, "samples_in_epoch": 0}
    checkpoint_dir = latest_checkpoint(exp_dir)
    if checkpoint_dir is not None:
        state = load_checkpoint(checkpoint_dir, model, optimizer, lr_schedule, param_shapes)
        print(f"rank {rank}: resumed from {checkpoint_dir} at step {state['step']}")
    metrics_path = os.path.join(exp_dir, "metrics.jsonl")
    if rank == 0:
        truncate_metrics(metrics_path, after_step=state["step"])

    # NOTE: compile AFTER sharding: the all-gathers and reduce-scatters run in FSDP's hooks around each block.
    if args.compile:
        model.compile()
    if args.wandb and rank == 0:
        import wandb

        # NOTE: id + resume="allow" makes a relaunch of the same experiment continue the same wandb run.
        wandb.init(
            project="distributed-training-guide", name=args.experiment_name, id=args.experiment_name,
            resume="allow", dir=exp_dir, config=vars(args),
        )

    # NOTE: schedulers (Slurm preemption, time limits) send a signal before they kill a job: we finish the
    # current step, save a checkpoint and exit, so a relaunch of the same command loses nothing.
    stop_requested = threading.Event()
    for stop_signal in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(stop_signal, lambda signum, frame: stop_requested.set())

    autocast = torch.autocast(device.type, dtype=compute_dtype) if compute_dtype != torch.float32 else nullcontext()
    peak_flops = peak_flops_per_second(device)
    order = epoch_order(len(data), args.seed, state["epoch"])
    running_loss, steps_since_log = torch.zeros((), device=device), 0
    progress = tqdm(
        total=total_steps, initial=state["step"], desc="training", disable=rank != 0 or not sys.stderr.isatty()
    )
    last_log_time = time.perf_counter()
    first_step = state["step"]
    model.train()

    while state["step"] < total_steps:
        if state["samples_in_epoch"] + global_batch_size > len(data):
            state["epoch"] += 1
            state["samples_in_epoch"] = 0
            order = epoch_order(len(data), args.seed, state["epoch"])
        batch_indices = order[state["samples_in_epoch"] : state["samples_in_epoch"] + global_batch_size]
        state["samples_in_epoch"] += global_batch_size
        # NOTE: every rank computes the same global batch and takes its own slice: N ranks at -b b see exactly
        # the samples that one process sees at -b N*b.
        local_indices = batch_indices[rank * args.batch_size : (rank + 1) * args.batch_size]
        batch = torch.from_numpy(data[local_indices]["input_ids"]).to(device, non_blocking=True)
        # NOTE: each row holds seq_length + 1 tokens: the model reads the first seq_length and predicts the last.
        input_ids, labels = batch[:, :-1], batch[:, 1:]

        with autocast:
            logits = model(input_ids=input_ids, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        if state["step"] == first_step:
            # NOTE: right after the first update each rank holds its shards of all three: weights, gradients and
            # Adam's two moments. Full sizes for comparison: this rank holds about 1/N of each.
            # NOTE: one write with its newline, so two ranks' lines on one terminal cannot interleave.
            sys.stdout.write(f"rank {rank}: sharded_bytes {json.dumps(sharded_bytes(model, optimizer))}\n")
        # NOTE: read before the schedule advances, so the logged lr is the one this step used.
        step_lr = lr_schedule.get_last_lr()[0]
        lr_schedule.step()
        optimizer.zero_grad(set_to_none=True)
        state["step"] += 1
        progress.update(1)

        # NOTE: losses stay on the device until a log step; calling .item() every step would make the CPU
        # wait for the GPU each step.
        running_loss += loss.detach()
        steps_since_log += 1
        if state["step"] % args.log_freq == 0 or state["step"] == total_steps:
            # NOTE: each rank's loss covers only its slice; the average over ranks is the global batch's loss.
            dist.all_reduce(running_loss, op=dist.ReduceOp.AVG)
            mean_loss = running_loss.item() / steps_since_log
            elapsed = time.perf_counter() - last_log_time
            tokens_per_s = tokens_per_step * steps_since_log / elapsed
            metrics = {
                "step": state["step"],
                "epoch": state["epoch"],
                "loss": mean_loss,
                "grad_norm": grad_norm.item(),
                "lr": step_lr,
                "tokens_per_s": tokens_per_s,
                "peak_memory_gb": peak_memory_gb(device),
            }
            if peak_flops is not None:
                # NOTE: tokens_per_s counts the tokens of all ranks, so the peak is that of all their GPUs.
                metrics["mfu"] = tokens_per_s * flops_per_token / (peak_flops * world_size)
            if rank == 0:
                log_metrics(metrics_path, metrics, progress)
            if args.wandb and rank == 0:
                wandb.log(metrics, step=state["step"])
            running_loss.zero_()
            steps_since_log = 0
            last_log_time = time.perf_counter()

        # NOTE: each rank holds different shards, so every rank writes its own part of the checkpoint.
        if state["step"] % args.ckpt_freq == 0 or state["step"] == total_steps:
            save_checkpoint(exp_dir, state, param_shapes, model, optimizer, lr_schedule)
        # NOTE: ranks may see a signal at different steps; they agree (MAX over ranks) so all stop at the same one.
        stop_now = torch.tensor(float(stop_requested.is_set()), device=device)
        dist.all_reduce(stop_now, op=dist.ReduceOp.MAX)
        if stop_now.item():
            save_checkpoint(exp_dir, state, param_shapes, model, optimizer, lr_schedule)
            break

    progress.close()
    if state["step"] == total_steps:
        export_hf(os.path.join(exp_dir, "hf"), model, tokenizer)
    if args.wandb and rank == 0:
        wandb.finish()
    dist.destroy_process_group()
    if state["step"] < total_steps:
        # NOTE: exit 1 without the interpreter's teardown, for the reason given at the end of this file.
        print(f"stopped by a signal after step {state['step']}; relaunch the same command to resume", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def get_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model-name", default=None,
                        help="Hugging Face model id or local folder (default: a tiny Llama built offline)")
    parser.add_argument("--from-pretrained", action="store_true",
                        help="load the weights of -m (default: fresh weights from -m's config)")
    parser.add_argument("-d", "--dataset-name", default=None,
                        help="Hugging Face dataset id, or a local file/folder of .txt/.json/.jsonl/.parquet/.csv "
                             "with a 'text' column (default: an offline synthetic corpus)")
    parser.add_argument("--dataset-subset", default=None, help="dataset configuration, e.g. wikitext-2-raw-v1")
    parser.add_argument("-b", "--batch-size", type=positive_int, default=8, help="sequences per step on this device")
    parser.add_argument("-s", "--seq-length", type=positive_int, default=128, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--max-steps", type=positive_int, default=None,
                        help="stop after this many steps (default: epochs)")
    parser.add_argument("--num-epochs", type=positive_int, default=1)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="compute dtype (default: bfloat16 on CUDA, float32 on CPU); weights stay float32")
    parser.add_argument("--attn-implementation", default="sdpa", help="sdpa, eager or flash_attention_2")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--cpu-offload", action="store_true",
                        help="keep the sharded weights, gradients and optimizer state in CPU memory")
    parser.add_argument("--replicate-degree", type=positive_int, default=1,
                        help="HSDP: shard within groups of WORLD_SIZE/R ranks (e.g. a node), replicate across R groups")
    parser.add_argument("-e", "--experiment-name", default="default",
                        help="name of the run; relaunching the same name resumes it")
    parser.add_argument("--save-dir", default="outputs", help="where <experiment-name>/ is written")
    parser.add_argument("--ckpt-freq", type=positive_int, default=100, help="save a checkpoint every this many steps")
    parser.add_argument("--log-freq", type=positive_int, default=10, help="log metrics every this many steps")
    parser.add_argument("--wandb", action="store_true", help="log to Weights & Biases")
    return parser


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def make_device_mesh(device, world_size, replicate_degree):
    """The ranks as a grid. FSDP shards every weight over the "shard" dimension. HSDP (--replicate-degree R)
    keeps R copies of the model, each sharded over WORLD_SIZE / R ranks (one node, say), so the all-gathers
    stay inside a node and only gradients cross nodes (all-reduced between the copies)."""
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


def make_experiment_dir(save_dir, experiment_name):
    exp_dir = os.path.join(save_dir, experiment_name)
    try:
        os.makedirs(exp_dir, exist_ok=True)
        probe = os.path.join(exp_dir, f".write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as error:
        sys.exit(f"error: cannot write to --save-dir {save_dir!r} ({error.strerror}); pass a writable folder")
    return exp_dir


def load_config_and_tokenizer(args):
    if args.model_name is None:
        if args.from_pretrained:
            sys.exit("error: --from-pretrained needs -m/--model-name (the default tiny model has no weights)")
        config, tokenizer = tiny_llama_config(), transformers.ByT5Tokenizer(extra_ids=0)
    else:
        try:
            config = transformers.AutoConfig.from_pretrained(args.model_name)
            tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_name)
        except Exception as error:
            sys.exit(
                f"error: cannot load model {args.model_name!r} ({first_line(error)}); pass a Hugging Face model id "
                "or a local folder with config.json and a tokenizer"
            )
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions is not None and args.seq_length > max_positions:
        sys.exit(
            f"error: -s/--seq-length {args.seq_length} is longer than {args.model_name or 'the tiny model'}'s "
            f"{max_positions} positions; pass -s {max_positions} or less"
        )
    return config, tokenizer


def tiny_llama_config():
    # NOTE: vocab 272 = ByT5's 259 byte tokens rounded up so it divides by 2, 4, 8, 16 (tensor parallel shards).
    return transformers.LlamaConfig(
        vocab_size=272, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=1024, bos_token_id=None, eos_token_id=1, pad_token_id=0,
    )


def build_model(args, config, device, mesh, compute_dtype):
    try:
        # NOTE: on the meta device tensors have shapes but no storage: building even a 70B model here allocates
        # nothing. Each rank allocates only its own shards, after sharding.
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(
                config, dtype=torch.float32, attn_implementation=args.attn_implementation
            )
    except (ImportError, ValueError, OSError) as error:
        sys.exit(f"error: cannot build model {args.model_name or 'tiny-llama'!r}: {first_line(error)}")
    shard_model(model, mesh, compute_dtype, args.cpu_offload, device)
    # NOTE: to_empty gives each rank uninitialised storage for its shards (and for the buffers). With
    # --cpu-offload the shards live in CPU memory; FSDP copies each block to the GPU when it runs.
    model.to_empty(device="cpu" if args.cpu_offload else device)
    initialize_weights(model, mesh, args.seed)
    if args.from_pretrained:
        load_pretrained_weights(model, args.model_name)
    return model


def shard_model(model, mesh, compute_dtype, cpu_offload, device):
    """fully_shard each transformer block, then the root. Each call makes one group whose weights are
    all-gathered just before it runs and freed just after, and whose gradients are reduce-scattered."""
    # NOTE: the fp32 shards are the master weights. param_dtype=bf16 casts them before the all-gather (half the
    # bytes to send, compute in bf16); reduce_dtype=fp32 sums gradients in fp32 so small ones are not lost.
    fsdp_options = dict(
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32),
        # NOTE: pinned (page-locked) CPU memory speeds up copies to the GPU; without CUDA it cannot be allocated.
        offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy(),
    )
    for block in transformer_blocks(model):
        fully_shard(block, **fsdp_options)
    # NOTE: the root's group takes every weight no block holds: embeddings, final norm, lm_head.
    fully_shard(model, **fsdp_options)


def transformer_blocks(model):
    """The repeated layers, found by the class names Hugging Face never splits across devices
    (`_no_split_modules`: LlamaDecoderLayer, Qwen2DecoderLayer, MistralDecoderLayer, ...)."""
    block_classes = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [module for module in model.modules() if type(module).__name__ in block_classes]
    if not blocks:
        sys.exit(
            f"error: cannot find the transformer blocks of {type(model).__name__} to shard (its _no_split_modules "
            "names none); use a decoder model such as Llama, Qwen, Mistral or Gemma"
        )
    return blocks


def initialize_weights(model, mesh, seed):
    """Fill this rank's shards as from_config fills a whole model: Hugging Face's init (the distributions of
    chapter 01, e.g. normal(0, 0.02) weights and ones in the norms), and the buffers that no checkpoint holds."""
    # NOTE: RoPE's inv_freq is a non-persistent buffer: it is in no state dict, so loading weights never
    # restores it, and after to_empty it holds garbage. Training would run without error, but wrong.
    # HF's init recomputes it from the config.
    # NOTE: on CUDA, DTensor draws each shard from its own offset of one random stream shared by all ranks. On
    # CPU each rank draws from its own generator: seeding it by shard index makes shards differ (not copies of
    # each other) and HSDP replicas agree.
    torch.default_generator.manual_seed(seed + mesh.get_local_rank("shard"))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        model.initialize_weights()
    # NOTE: HF zeroes the padding token's embedding row through weight[padding_idx], which on a sharded weight
    # edits a temporary copy. Zero it in the shard that holds it (fully_shard splits dim 0 like torch.chunk).
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:
            local_rows = module.weight.to_local()
            first_row = mesh.get_local_rank("shard") * math.ceil(module.num_embeddings / mesh["shard"].size())
            if 0 <= module.padding_idx - first_row < local_rows.shape[0]:
                with torch.no_grad():
                    local_rows[module.padding_idx - first_row].zero_()


def load_pretrained_weights(model, model_name):
    """Rank 0 reads the checkpoint into CPU memory; the others get their shards from it, tensor by tensor."""
    full_state_dict = {}
    if dist.get_rank() == 0:
        try:
            full_state_dict = transformers.AutoModelForCausalLM.from_pretrained(
                model_name, dtype=torch.float32
            ).state_dict()
        except (ImportError, ValueError, OSError) as error:
            sys.exit(f"error: cannot load the weights of {model_name!r}: {first_line(error)}")
    # NOTE: rank 0 holds one full fp32 copy (4 bytes per parameter) in CPU memory until this returns.
    set_model_state_dict(
        model, full_state_dict, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )


def load_and_pack(args, tokenizer):
    """Tokenize every document, join them with EOS between documents, and cut the token stream into rows
    of seq_length + 1 tokens. datasets caches the result next to the downloaded data."""
    if args.dataset_name is None:
        raw = datasets.Dataset.from_dict({"text": tiny_corpus()})
    else:
        raw = load_raw_dataset(args.dataset_name, args.dataset_subset)
    if "text" not in raw.column_names:
        sys.exit(f"error: dataset {args.dataset_name!r} has no 'text' column (it has {raw.column_names})")
    row_length = args.seq_length + 1
    eos = tokenizer.eos_token_id

    def tokenize_and_pack(batch):
        stream = []
        for ids in tokenizer(batch["text"])["input_ids"]:
            stream.extend(ids)
            if eos is not None and (not ids or ids[-1] != eos):
                stream.append(eos)
        num_rows = len(stream) // row_length
        return {"input_ids": [stream[i * row_length : (i + 1) * row_length] for i in range(num_rows)]}

    packed = raw.map(tokenize_and_pack, batched=True, batch_size=1000, remove_columns=raw.column_names,
                     desc=f"tokenize and pack into rows of {row_length}")
    return packed.with_format("numpy")


def load_raw_dataset(name, subset):
    builders = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
    try:
        if os.path.isfile(name):
            extension = os.path.splitext(name)[1]
            if extension not in builders:
                sys.exit(f"error: cannot read {name!r}: use a {', '.join(builders)} file or a folder of them")
            return datasets.load_dataset(builders[extension], data_files=name, split="train")
        return datasets.load_dataset(name, subset, split="train")
    except Exception as error:
        sys.exit(
            f"error: cannot load dataset {name!r} ({first_line(error)}); pass a Hugging Face dataset id "
            "(and --dataset-subset if it has several), or a local file or folder"
        )


def tiny_corpus(num_documents=4000, seed=1234):
    """Short stories with structure a tiny model can learn in a minute: templates, names and sums."""
    rng = random.Random(seed)
    names = ["Ada", "Ben", "Cleo", "Dev", "Eva", "Finn", "Gia", "Hugo", "Ines", "Jon", "Kai", "Lena"]
    things = ["apples", "books", "coins", "shells", "stamps", "marbles", "pencils", "cards"]
    documents = []
    for _ in range(num_documents):
        giver, taker = rng.sample(names, 2)
        thing = rng.choice(things)
        had, given = rng.randint(1, 20), rng.randint(1, 20)
        documents.append(
            f"{taker} has {had} {thing}. {giver} gives {taker} {given} more {thing}. "
            f"Now {taker} has {had + given} {thing}."
        )
    return documents


def warmup_then_cosine(step, warmup_steps, total_steps, final_fraction=0.1):
    """Multiplier of the peak learning rate: linear warmup, then one cosine down to final_fraction at the end."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * progress))


def epoch_order(num_rows, seed, epoch):
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


def training_flops_per_token(model, config, seq_length):
    """6 FLOPs per parameter per token (forward + backward) for the matmuls, plus attention scores
    (12 * layers * hidden * seq_length, PaLM appendix B). Embedding lookups are not matmuls."""
    num_params = sum(p.numel() for p in model.parameters())
    num_params -= model.get_input_embeddings().weight.numel()
    return 6 * num_params + 12 * config.num_hidden_layers * config.hidden_size * seq_length


def peak_flops_per_second(device):
    """Dense bf16 tensor-core peak of the GPU (datasheet numbers, without sparsity), or None if unknown."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in [("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("GH200", 989e12),
                       ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12), ("A10G", 70e12)]:
        if key in name:
            print(f"MFU is relative to {flops / 1e12:.0f} TFLOP/s, the dense bf16 peak of {name}")
            return flops
    print(f"unknown peak FLOP/s for {name}: MFU is not reported")
    return None


def peak_memory_gb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource  # NOTE: Unix only; on CPU the process's peak resident memory is the honest number

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20


def sharded_bytes(model, optimizer):
    """[bytes on this rank, bytes of the whole model] of weights, gradients and optimizer state."""

    def local_and_full(tensors):
        tensors = list(tensors)
        local = sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)
        return [local, sum(t.numel() * t.element_size() for t in tensors)]

    return {
        "parameters": local_and_full(model.parameters()),
        "gradients": local_and_full(p.grad for p in model.parameters() if p.grad is not None),
        "optimizer_state": local_and_full(
            value for param_state in optimizer.state.values() for value in param_state.values() if torch.is_tensor(value)
        ),
    }


def log_metrics(path, metrics, progress):
    with open(path, "a") as f:
        f.write(json.dumps(metrics) + "\n")
    progress.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}")
    progress.write(" | ".join(f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()))


def truncate_metrics(path, after_step):
    """After a resume, drop the lines that the interrupted run logged past its last checkpoint."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] <= after_step]
    with open(path, "w") as f:
        f.writelines(kept)


def latest_checkpoint(exp_dir):
    """Newest complete checkpoint. A save writes into step-N.partial and renames it to step-N when done,
    so a run killed mid-save leaves only a .partial folder, which is ignored."""
    checkpoints_dir = os.path.join(exp_dir, "checkpoints")
    if not os.path.isdir(checkpoints_dir):
        return None
    complete = sorted(name for name in os.listdir(checkpoints_dir) if name.startswith("step-") and "." not in name)
    return os.path.join(checkpoints_dir, complete[-1]) if complete else None


def save_checkpoint(exp_dir, state, param_shapes, model, optimizer, lr_schedule):
    checkpoints_dir = os.path.join(exp_dir, "checkpoints")
    final_dir = os.path.join(checkpoints_dir, f"step-{state['step']:08d}")
    partial_dir = final_dir + ".partial"
    if os.path.exists(final_dir):
        return
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(partial_dir, ignore_errors=True)
        os.makedirs(partial_dir)
    dist.barrier()
    # NOTE: get_state_dict names each shard by its parameter's full name and offsets, so a checkpoint written
    # by N ranks loads into any number of ranks. dcp.save writes one file per rank, then rank 0 writes the
    # index (.metadata) once every rank's file is complete. Checkpoints need a folder all nodes share.
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=partial_dir)
    if rank == 0:
        torch.save(
            {
                "lr_schedule": lr_schedule.state_dict(),
                # NOTE: the data order has its own generator; these cover anything random in the model (dropout).
                "rng": {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all()},
            },
            os.path.join(partial_dir, "checkpoint.pt"),
        )
        with open(os.path.join(partial_dir, "state.json"), "w") as f:
            json.dump({**state, "param_shapes": param_shapes}, f)
        # NOTE: the rename is atomic: a crash before it leaves the previous checkpoint as the newest complete one.
        os.rename(partial_dir, final_dir)
        for name in os.listdir(checkpoints_dir):
            if name != os.path.basename(final_dir):
                shutil.rmtree(os.path.join(checkpoints_dir, name), ignore_errors=True)
    # NOTE: no rank goes on (or checks for this checkpoint again) before it is complete.
    dist.barrier()


def load_checkpoint(checkpoint_dir, model, optimizer, lr_schedule, param_shapes):
    with open(os.path.join(checkpoint_dir, "state.json")) as f:
        state = json.load(f)
    saved_shapes = state.pop("param_shapes")
    if saved_shapes != param_shapes:
        sys.exit(
            f"error: checkpoint {checkpoint_dir} holds a different model ({describe_mismatch(saved_shapes, param_shapes)}); "
            "pass the -m it was trained with, or a new -e/--experiment-name to start fresh"
        )
    checkpoint = torch.load(os.path.join(checkpoint_dir, "checkpoint.pt"), map_location="cpu", weights_only=True)
    # NOTE: dcp.load fills these tensors in place, each rank reading only its own shards. The optimizer goes
    # through get_state_dict/set_state_dict: a fresh optimizer has no state tensors to fill, and loading into
    # optimizer.state_dict() would silently restore nothing.
    model_state, optimizer_state = get_state_dict(model, optimizer)
    sharded = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(sharded, checkpoint_id=checkpoint_dir)
    set_state_dict(model, optimizer, model_state_dict=sharded["model"], optim_state_dict=sharded["optimizer"])
    lr_schedule.load_state_dict(checkpoint["lr_schedule"])
    torch.set_rng_state(checkpoint["rng"]["cpu"])
    if torch.cuda.is_available() and checkpoint["rng"]["cuda"]:
        torch.cuda.set_rng_state_all(checkpoint["rng"]["cuda"])
    return state


def describe_mismatch(saved_shapes, param_shapes):
    for name in sorted(set(saved_shapes) | set(param_shapes)):
        if saved_shapes.get(name) != param_shapes.get(name):
            return f"{name}: {saved_shapes.get(name)} in the checkpoint, {param_shapes.get(name)} in this model"
    return "same parameters"


def export_hf(hf_dir, model, tokenizer):
    """Write the trained model in Hugging Face format: AutoModelForCausalLM.from_pretrained(hf_dir) loads it."""
    # NOTE: the full weights are gathered one tensor at a time into rank 0's CPU memory; the other ranks keep
    # nothing. Rank 0 holds the full model (4 bytes per parameter) only until it is written.
    full_state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        # NOTE: a tied weight (lm_head = input embeddings) is gathered once per name; point all its names at one
        # copy so save_pretrained sees the tie and writes it once, as Hugging Face checkpoints hold it.
        names_by_param = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            names_by_param.setdefault(param, []).append(name)
        for first_name, *tied_names in names_by_param.values():
            full_state_dict.update({name: full_state_dict[first_name] for name in tied_names})
        model.save_pretrained(hf_dir, state_dict=full_state_dict)
        tokenizer.save_pretrained(hf_dir)
        print(f"saved the trained model to {hf_dir}")


def first_line(error):
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


if __name__ == "__main__":
    main()
    # NOTE: exit without the interpreter's teardown. DeviceMesh and DTensor caches keep the gloo process groups
    # alive, so their worker threads still run while Python shuts down and can abort the finished process
    # ("terminate called without an active exception", pytorch/pytorch#190489). Everything is saved by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
