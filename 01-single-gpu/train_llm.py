"""Train a causal language model on one device (a GPU if there is one, else the CPU).

    python train_llm.py                                   # tiny Llama, offline corpus, any laptop
    python train_llm.py -m meta-llama/Llama-3.2-1B -d roneneldan/TinyStories --lr 3e-4

Every later chapter starts from this file and adds one distributed technique to it.
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
from contextlib import nullcontext

import datasets
import numpy as np
import torch
import torch.nn.functional as F
import transformers
from tqdm import tqdm


def main():
    args = get_parser().parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # NOTE: weights and optimizer state stay fp32 (the "master" copy); only the forward/backward math runs in
    # --dtype. Pure bf16 weights lose small updates: at lr 3e-5 most bf16 weights would never change.
    compute_dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    exp_dir = make_experiment_dir(args.save_dir, args.experiment_name)
    torch.manual_seed(args.seed)

    config, tokenizer = load_config_and_tokenizer(args)
    model = build_model(args, config, device)
    param_shapes = {name: list(p.shape) for name, p in model.named_parameters()}
    flops_per_token = training_flops_per_token(model, config, args.seq_length)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, compute in {compute_dtype}")

    data = load_and_pack(args, tokenizer)
    global_batch_size = args.batch_size
    tokens_per_step = global_batch_size * args.seq_length
    steps_per_epoch = len(data) // global_batch_size
    if steps_per_epoch == 0:
        sys.exit(
            f"error: the dataset gives {len(data)} sequences of {args.seq_length + 1} tokens, fewer than one batch "
            f"of {global_batch_size}; use a smaller -b/--batch-size or -s/--seq-length, or more data"
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
        print(f"resumed from {checkpoint_dir} at step {state['step']}")
    metrics_path = os.path.join(exp_dir, "metrics.jsonl")
    truncate_metrics(metrics_path, after_step=state["step"])

    if args.compile:
        model.compile()
    if args.wandb:
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
    progress = tqdm(total=total_steps, initial=state["step"], desc="training", disable=not sys.stderr.isatty())
    last_log_time = time.perf_counter()
    model.train()

    while state["step"] < total_steps:
        if state["samples_in_epoch"] + global_batch_size > len(data):
            state["epoch"] += 1
            state["samples_in_epoch"] = 0
            order = epoch_order(len(data), args.seed, state["epoch"])
        batch_indices = order[state["samples_in_epoch"] : state["samples_in_epoch"] + global_batch_size]
        state["samples_in_epoch"] += global_batch_size
        batch = torch.from_numpy(data[batch_indices]["input_ids"]).to(device, non_blocking=True)
        # NOTE: each row holds seq_length + 1 tokens: the model reads the first seq_length and predicts the last.
        input_ids, labels = batch[:, :-1], batch[:, 1:]

        with autocast:
            logits = model(input_ids=input_ids, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
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
                metrics["mfu"] = tokens_per_s * flops_per_token / peak_flops
            log_metrics(metrics_path, metrics, progress)
            if args.wandb:
                wandb.log(metrics, step=state["step"])
            running_loss.zero_()
            steps_since_log = 0
            last_log_time = time.perf_counter()

        if state["step"] % args.ckpt_freq == 0 or state["step"] == total_steps:
            save_checkpoint(exp_dir, state, param_shapes, model, optimizer, lr_schedule)
        if stop_requested.is_set():
            save_checkpoint(exp_dir, state, param_shapes, model, optimizer, lr_schedule)
            break

    progress.close()
    if state["step"] == total_steps:
        export_hf(os.path.join(exp_dir, "hf"), model, tokenizer)
    if args.wandb:
        wandb.finish()
    if state["step"] < total_steps:
        sys.exit(f"stopped by a signal after step {state['step']}; relaunch the same command to resume")


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


def build_model(args, config, device):
    try:
        # NOTE: building under `with device` allocates the weights directly on the GPU, not in host RAM first.
        with device:
            if args.from_pretrained:
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    args.model_name, dtype=torch.float32, attn_implementation=args.attn_implementation
                )
            else:
                model = transformers.AutoModelForCausalLM.from_config(
                    config, dtype=torch.float32, attn_implementation=args.attn_implementation
                )
    except (ImportError, ValueError, OSError) as error:
        sys.exit(f"error: cannot build model {args.model_name or 'tiny-llama'!r}: {first_line(error)}")
    return model


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
    shutil.rmtree(partial_dir, ignore_errors=True)
    os.makedirs(partial_dir)
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
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
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
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
    model.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    print(f"saved the trained model to {hf_dir}")


def first_line(error):
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


if __name__ == "__main__":
    main()
