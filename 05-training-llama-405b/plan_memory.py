"""Will a layout fit? Per-GPU and per-node memory of train_llm.py for a model, before a job queues for hours.
(This chapter's FSDP layouts; ../12-choosing-a-layout/plan.py plans every chapter's, tensor, pipeline, context
and expert parallel too, and builds a layout in a dry run.)

    python plan_memory.py                       # Llama 3.1 405B (llama-3.1-405b/config.json) on 8 x 8 GPUs
    python plan_memory.py --cpu-offload --activation-checkpointing --explicit-prefetch -s 4096
    python plan_memory.py meta-llama/Llama-3.1-8B --nodes 1 -b 2      # a Hub id, a folder, or a config.json

Counts what train_llm.py allocates: fp32 master weights, fp32 gradients and Adam's two fp32 moments, sharded
over the ranks as fully_shard shards them (dim 0, like torch.chunk); the weights and gradients FSDP gathers for
the blocks in flight (in --dtype); and the activations that backward needs (each tensor the model saves,
counted for Hugging Face's Llama with sdpa attention). Prints each part, whether it fits, and the largest
batch that does, and what each rank reads of the pretrained weights: its rows, in the dtypes the safetensors
headers beside the config name (else config.json's dtype). Exits 1 when the layout cannot work. Needs only the
standard library and transformers.
"""
import argparse
import json
import math
import os
import struct
import sys

import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
GB = 1e9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# the names of a safetensors header's common dtypes; a checkpoint's bytes come from the header's offsets.
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
CONFIG_DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


def main():
    args = get_parser().parse_args()
    config = load_config(args.model)
    plan = make_plan(config, args)
    if args.json:
        print(json.dumps(plan))
    else:
        print_plan(plan, args)
    if plan["error"]:
        sys.exit(1)


def get_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=os.path.join(HERE, "llama-3.1-405b"),
                        help="Hugging Face id, local folder or config.json (default: Llama 3.1 405B's config)")
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node (one per GPU)")
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory of one GPU (H100: 80)")
    parser.add_argument("--host-memory-gb", type=float, default=2048.0, help="CPU memory of one node")
    parser.add_argument("--headroom-gb", type=float, default=6.0,
                        help="GPU memory not available to tensors: CUDA context, NCCL buffers, fragmentation")
    parser.add_argument("-b", "--batch-size", type=int, default=1, help="sequences per step on each GPU")
    parser.add_argument("-s", "--seq-length", type=int, default=8192)
    parser.add_argument("--dtype", choices=DTYPE_BYTES, default="bfloat16",
                        help="compute dtype (weights stay fp32)")
    parser.add_argument("--replicate-degree", type=int, default=1,
                        help="HSDP: copies of the model (see chapter 04)")
    parser.add_argument("--cpu-offload", action="store_true")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--explicit-prefetch", action="store_true")
    parser.add_argument("--async-checkpoint", action="store_true",
                        help="count the host copy that each rank stages its checkpoint in")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object (bytes)")
    return parser


def load_config(model):
    try:
        if os.path.isfile(model):
            with open(model) as f:
                fields = json.load(f)
            return transformers.AutoConfig.for_model(**fields)
        return transformers.AutoConfig.from_pretrained(model)
    except Exception as error:
        sys.exit(f"error: cannot read the config of {model!r} ({str(error).strip().splitlines()[0]}); pass a "
                 "Hugging Face id, a folder with config.json, or a config.json")


def stored_tensors(model):
    """{name: (dtype, bytes)} of every tensor in the safetensors files of the model's folder (a config.json's
    folder), from their headers: 8 bytes of length, then JSON with each tensor's dtype and offsets. A Hub id
    has no local files: {}."""
    if not os.path.exists(model):
        return {}
    folder = model if os.path.isdir(model) else os.path.dirname(model) or "."
    tensors = {}
    for file in sorted(name for name in os.listdir(folder) if name.endswith(".safetensors")):
        path = os.path.join(folder, file)
        try:
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
            for name, entry in header.items():
                if name != "__metadata__":
                    start, end = entry["data_offsets"]
                    tensors[name] = (SAFETENSORS_DTYPES.get(entry["dtype"], entry["dtype"]), end - start)
        except (OSError, ValueError, KeyError, TypeError, struct.error) as error:
            sys.exit(f"error: cannot read the safetensors header of {path!r} ({error}); is it complete?")
    return tensors


def parameter_shapes(config):
    """(name, shape) of every weight of a Llama-family decoder (Llama, Mistral, Qwen2/3), as named_parameters
    lists them: a tied output head is the embedding and appears once."""
    hidden, vocab, inter = config.hidden_size, config.vocab_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_dim, kv_dim = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    attention_bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}."
        shapes += [(layer + "self_attn.q_proj.weight", (q_dim, hidden)),
                   (layer + "self_attn.k_proj.weight", (kv_dim, hidden)),
                   (layer + "self_attn.v_proj.weight", (kv_dim, hidden)),
                   (layer + "self_attn.o_proj.weight", (hidden, q_dim))]
        if attention_bias:
            shapes += [(layer + f"self_attn.{p}_proj.bias", (dim,))
                       for p, dim in zip("qkv", (q_dim, kv_dim, kv_dim))]
        if config.model_type == "qwen3":
            shapes += [(layer + "self_attn.q_norm.weight", (head_dim,)),
                       (layer + "self_attn.k_norm.weight", (head_dim,))]
        shapes += [(layer + "mlp.gate_proj.weight", (inter, hidden)),
                   (layer + "mlp.up_proj.weight", (inter, hidden)),
                   (layer + "mlp.down_proj.weight", (hidden, inter)),
                   (layer + "input_layernorm.weight", (hidden,)),
                   (layer + "post_attention_layernorm.weight", (hidden,))]
    shapes.append(("model.norm.weight", (hidden,)))
    if not getattr(config, "tie_word_embeddings", False):
        shapes.append(("lm_head.weight", (vocab, hidden)))
    return shapes


def numel(shape):
    return math.prod(shape)


def shard_numel(shape, shards):
    """Elements rank 0 holds (the most of any rank): fully_shard gives each rank ceil(rows / shards) rows."""
    return min(shape[0], math.ceil(shape[0] / shards)) * numel(shape[1:])


def activation_bytes_per_token(config, compute_bytes, checkpointing):
    """Bytes per token of the tensors autograd keeps between forward and backward, at their peak (the start of
    backward). Counted from what Hugging Face's Llama saves (sdpa attention; RMSNorm computes in fp32):"""
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv_dim = config.num_key_value_heads * head_dim
    b = compute_bytes
    # each RMSNorm: its input and the normalised vector in fp32, and the normalised vector in --dtype that the
    # next matmul saves; attention: q (and the output), k and v after RoPE, and sdpa's log-sum-exp (fp32, one
    # per head); MLP: gate, silu(gate), up and their product (intermediate_size each); two 1/rms scalars.
    per_layer = (2 * (4 + 2 * b) * hidden + b * (2 * hidden + 2 * kv_dim) + 4 * config.num_attention_heads
                 + 4 * b * inter + 2 * 4)
    # the final norm, the logits the loss keeps (log-softmax in fp32) plus the logits tensor itself, and the
    # token ids and labels (int64).
    outside_layers = (4 + 2 * b) * hidden + (4 + b) * vocab + 16
    # backward starts with the gradient of the logits (fp32, then --dtype): the peak.
    backward_start = (4 + b) * vocab
    if checkpointing:
        # a checkpointed block keeps only its input (one hidden vector); backward recomputes one block at a time
        return config.num_hidden_layers * b * hidden + outside_layers + backward_start + per_layer
    return config.num_hidden_layers * per_layer + outside_layers + backward_start


def make_plan(config, args):
    world = args.nodes * args.gpus_per_node
    plan = {"world_size": world, "error": None}
    if args.replicate_degree < 1 or world % args.replicate_degree:
        plan["error"] = (f"--replicate-degree {args.replicate_degree} does not divide the {world} GPUs "
                         f"({args.nodes} nodes x {args.gpus_per_node}); pass a divisor, such as the node count")
        return plan
    shards = world // args.replicate_degree
    b = DTYPE_BYTES[args.dtype]
    shapes = parameter_shapes(config)
    thinnest = min(shapes, key=lambda item: item[1][0])
    if thinnest[1][0] < shards:
        plan["error"] = (f"{shards} GPUs share each weight but {thinnest[0]} has only {thinnest[1][0]} rows: "
                         f"some GPUs would hold nothing of it; use at most {thinnest[1][0]} GPUs per copy "
                         "(more --replicate-degree) for this model")
        return plan
    total_params = sum(numel(shape) for _, shape in shapes)
    local_params = sum(shard_numel(shape, shards) for _, shape in shapes)
    # Adam keeps a step counter per weight: a 4-byte scalar every rank holds whole.
    state = {
        "parameters": 4 * local_params,
        "gradients": 4 * local_params,
        "optimizer_state": 2 * 4 * local_params + 4 * len(shapes),
    }
    block_params = sum(numel(shape) for name, shape in shapes if name.startswith("model.layers.0."))
    vocab_params = config.vocab_size * config.hidden_size
    # The gathered weights of the blocks in flight (the one computing, the next one arriving; with explicit
    # prefetch one more), or of the output head, which stays gathered from its forward to its backward. And in
    # backward one block's (or the head's) full gradients, in --dtype and, to reduce them in fp32, an fp32 copy.
    blocks_gathered = 3 if args.explicit_prefetch else 2
    gathered = b * max(blocks_gathered * block_params, 2 * vocab_params)
    gathered_gradients = (b + (4 if b != 4 else 0)) * max(block_params, vocab_params)
    per_sequence = args.seq_length * activation_bytes_per_token(config, b, args.activation_checkpointing)
    on_gpu_state = 0 if args.cpu_offload else sum(state.values())
    usable = (args.gpu_memory_gb - args.headroom_gb) * GB
    largest_batch = max(0, int((usable - on_gpu_state - gathered - gathered_gradients) // per_sequence))
    host_state = args.gpus_per_node * sum(state.values()) if args.cpu_offload else 0
    # --async-checkpoint: each rank copies its weights and Adam moments to host memory, kept for the whole run.
    staging = args.gpus_per_node * (state["parameters"] + state["optimizer_state"]) if args.async_checkpoint else 0
    load_bytes, load_dtypes, load_dtypes_from = load_read(config, args.model, shapes, shards)
    plan.update(
        config=type(config).__name__, total_parameters=total_params, shards=shards,
        per_gpu={**state, "gathered_weights": gathered, "gathered_gradients": gathered_gradients,
                 "activations": args.batch_size * per_sequence},
        per_gpu_on_device=on_gpu_state + gathered + gathered_gradients + args.batch_size * per_sequence,
        usable_gpu_bytes=usable, largest_batch=largest_batch, per_node_host_state=host_state,
        per_node_checkpoint_staging=staging,
        # what each rank reads during the load (its rows, as stored), and what chapter 04's load holds
        load_bytes_per_rank=load_bytes, load_dtypes=load_dtypes, load_dtypes_from=load_dtypes_from,
        rank0_full_load_bytes=4 * total_params,
    )
    if plan["per_gpu_on_device"] > usable:
        remedies = [flag for flag in ("--cpu-offload", "--activation-checkpointing")
                    if flag not in options_on(args)] + ["a shorter -s", "more nodes"]
        plan["error"] = (f"does not fit: {plan['per_gpu_on_device'] / GB:.1f} GB per GPU, "
                         f"{usable / GB:.1f} GB usable"
                         + (f"; the largest batch that fits is -b {largest_batch}" if largest_batch else
                            f"; no batch fits: try {', '.join(remedies)}"))
    elif host_state + staging > args.host_memory_gb * GB:
        held = " and ".join(what for what, n in (("the offloaded state", host_state),
                                                 ("the checkpoint's staging copy", staging)) if n)
        plan["error"] = (f"does not fit: {held} need {size(host_state + staging)} of CPU memory per node, "
                         f"which has {size(args.host_memory_gb * GB)}; use more nodes")
    return plan


def load_read(config, model, shapes, shards):
    """Bytes the fullest rank reads from the checkpoint (its rows of every weight, in the dtype each is stored
    in), the dtypes, and where they were found: the safetensors headers, else config.json's dtype."""
    stored = stored_tensors(model)
    configured = str(getattr(config, "dtype", None) or "").removeprefix("torch.")
    total, dtypes, sources = 0, set(), set()
    for name, shape in shapes:
        if name in stored:
            (dtype, stored_bytes), source = stored[name], "the safetensors headers"
        else:
            # a Hub id, or a folder without weights: config.json's dtype is the one the weights were saved in
            dtype, source = configured or "bfloat16", "config.json's dtype" if configured else "an assumption"
            stored_bytes = CONFIG_DTYPE_BYTES.get(dtype, 2) * numel(shape)
        # a rank's rows of a weight are that share of its bytes (dim-0 rows are contiguous in the file)
        total += stored_bytes * shard_numel(shape, shards) // numel(shape)
        dtypes.add(dtype)
        sources.add(source)
    return total, sorted(dtypes), sorted(sources)


def size(n):
    """n bytes with the precision a reader needs: 1623 GB, 12.68 GB, 0.54 GB, 3.44 MB."""
    for unit, scale in (("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if n >= 0.1 * scale:
            return f"{n / scale:.0f} {unit}" if n >= 1000 * scale else f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def options_on(args):
    return [flag for flag in ("--cpu-offload", "--activation-checkpointing", "--explicit-prefetch",
                              "--async-checkpoint") if getattr(args, flag[2:].replace("-", "_"))]


def print_plan(plan, args):
    if "per_gpu" not in plan:
        print(f"error: {plan['error']}")
        return
    where = "CPU" if args.cpu_offload else "GPU"
    print(f"{plan['config']}, {plan['total_parameters'] / 1e9:.2f}B parameters, on {args.nodes} nodes x "
          f"{args.gpus_per_node} GPUs: each weight sharded {plan['shards']} ways")
    print(" ".join([f"-b {args.batch_size} -s {args.seq_length} --dtype {args.dtype}", *options_on(args)]))
    rows = [("fp32 weights (shard)", "parameters", where), ("fp32 gradients (shard)", "gradients", where),
            ("Adam moments (shard)", "optimizer_state", where), ("gathered weights", "gathered_weights", "GPU"),
            ("gathered gradients", "gathered_gradients", "GPU"), ("activations", "activations", "GPU")]
    for label, key, place in rows:
        print(f"  {label:<32} {size(plan['per_gpu'][key]):>12}  on the {place}")
    fits = plan["error"] is None
    print(f"  {'on each GPU':<32} {size(plan['per_gpu_on_device']):>12}  of "
          f"{plan['usable_gpu_bytes'] / GB:.1f} GB usable ({args.gpu_memory_gb:g} less {args.headroom_gb:g} "
          f"headroom): {'fits' if fits else 'does NOT fit'}")
    print(f"  {'largest batch that fits':<32} {'-b ' + str(plan['largest_batch']):>9}")
    if args.cpu_offload:
        print(f"  {'offloaded state on each node':<32} {size(plan['per_node_host_state']):>12}  of "
              f"{args.host_memory_gb:g} GB CPU memory")
    if args.async_checkpoint:
        print(f"  {'checkpoint staging on each node':<32} {size(plan['per_node_checkpoint_staging']):>12}  of "
              f"{args.host_memory_gb:g} GB CPU memory (a copy of each rank's weights and Adam moments)")
    dtypes, sources = " + ".join(plan["load_dtypes"]), " and ".join(plan["load_dtypes_from"])
    full_load = size(plan["rank0_full_load_bytes"])
    print(f"  {'pretrained load, each rank reads':<32} {size(plan['load_bytes_per_rank']):>12}  (its rows, "
          f"in {dtypes} per {sources}; chapter 04's load holds {full_load} on rank 0)")
    if not fits:
        print(f"error: {plan['error']}")


if __name__ == "__main__":
    main()
