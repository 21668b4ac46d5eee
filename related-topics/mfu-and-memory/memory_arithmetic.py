"""Bytes per parameter and FLOPs per token of chapter 01's tiny Llama: predicted, then measured on the CPU.

    python memory_arithmetic.py                                  # the tiny Llama: predicted vs measured bytes
    python memory_arithmetic.py --params 8.03e9 --world-size 8   # what each chapter holds per GPU for 8B

Predicts the bytes of the fp32 weights, gradients and AdamW state (4 + 4 + 8 bytes a parameter, and a 4-byte
step counter per weight tensor), takes optimizer steps as the chapters do, and sums the bytes of the tensors
that exist afterwards. Then measures the activations autograd saves for backward, in fp32 and under bf16
autocast, at two sequence lengths: the difference is the cost per token, the rest is what autocast adds per
parameter. Prints the tables and writes them to <save-dir>/memory.json.
"""
import argparse
import json
import os

import torch
import torch.nn.functional as F
import transformers


def main():
    args = get_parser().parse_args()
    if args.params is not None:
        print(format_per_rank(args.params, args.world_size))
        return
    torch.manual_seed(0)
    model = build_tiny_model(args.tied)
    num_params = sum(p.numel() for p in model.parameters())
    num_tensors = len(list(model.parameters()))
    config = model.config
    flops = flops_per_token(num_params, config.vocab_size, config.hidden_size, config.num_hidden_layers,
                            args.seq_length, args.tied)
    print(f"tiny Llama: {num_params:,} parameters in {num_tensors} tensors, {flops:,} FLOPs per token at "
          f"-s {args.seq_length}")

    predicted = predicted_state_bytes(num_params, num_tensors)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(args.max_steps):
        train_step(model, optimizer, args.batch_size, args.seq_length)
    measured = measured_state_bytes(model, optimizer)
    print(f"\nafter {args.max_steps} AdamW step(s), fp32:\n")
    print("| | predicted bytes | measured bytes | bytes per parameter |\n|---|---|---|---|")
    for part in predicted:
        print(f"| {part} | {predicted[part]:,} | {measured[part]:,} | {measured[part] / num_params:.2f} |")
    print(f"| total | {sum(predicted.values()):,} | {sum(measured.values()):,} | "
          f"{sum(measured.values()) / num_params:.2f} |")

    activations = {dtype: activation_bytes(model, args.batch_size, args.seq_length, dtype)
                   for dtype in ("float32", "bfloat16")}
    print(f"\nactivations saved for backward (-b {args.batch_size}, -s {args.seq_length} and "
          f"{2 * args.seq_length}):\n")
    print("| compute dtype | bytes per token | bytes independent of tokens | of which per parameter |\n"
          "|---|---|---|---|")
    for dtype, (per_token, constant) in activations.items():
        print(f"| {dtype} | {per_token:,.0f} | {constant:,.0f} | {constant / num_params:.2f} |")
    print()
    print(format_per_rank(num_params, args.world_size))

    os.makedirs(args.save_dir, exist_ok=True)
    with open(os.path.join(args.save_dir, "memory.json"), "w") as f:
        json.dump({"parameters": num_params, "flops_per_token": flops, "predicted": predicted,
                   "measured": measured, "activations": activations}, f, indent=1)


def get_parser():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-b", "--batch-size", type=positive_int, default=8)
    parser.add_argument("-s", "--seq-length", type=positive_int, default=128)
    parser.add_argument("--tied", action="store_true", help="tie the output head to the embedding")
    parser.add_argument("--max-steps", type=positive_int, default=1, help="optimizer steps before measuring")
    parser.add_argument("--world-size", type=positive_int, default=8, help="GPUs of the per-rank table")
    parser.add_argument("--params", type=float, default=None,
                        help="only print the per-rank table for a model of this many parameters")
    parser.add_argument("--save-dir", default="outputs", help="where memory.json is written")
    return parser


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def build_tiny_model(tied):
    """Chapter 01's default tiny Llama (the same config), fp32, on the CPU."""
    config = transformers.LlamaConfig(
        vocab_size=272, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=1024, bos_token_id=None, eos_token_id=1,
        pad_token_id=0, tie_word_embeddings=tied,
    )
    return transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="sdpa"
    )


def flops_per_token(num_params, vocab_size, hidden_size, num_layers, seq_length, tied):
    """6 FLOPs per matmul weight per token (2 forward, 4 backward) + 12 * layers * hidden * seq_length for the
    attention scores. Every parameter is a matmul weight except the input embedding, a lookup; when the head
    is tied to it, the one tensor is used once as a matmul, so it counts once."""
    matmul_params = num_params if tied else num_params - vocab_size * hidden_size
    return 6 * matmul_params + 12 * num_layers * hidden_size * seq_length


def predicted_state_bytes(num_params, num_tensors):
    # NOTE: AdamW keeps exp_avg and exp_avg_sq (fp32, one each per parameter) and a step count per tensor,
    # a 4-byte fp32 scalar.
    return {
        "parameters": 4 * num_params,
        "gradients": 4 * num_params,
        "optimizer_state": 8 * num_params + 4 * num_tensors,
    }


def train_step(model, optimizer, batch_size, seq_length):
    batch = torch.randint(0, model.config.vocab_size, (batch_size, seq_length + 1))
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    # NOTE: no zero_grad: the chapters free gradients only after the step, and they exist at the peak.


def measured_state_bytes(model, optimizer):
    """Bytes of the tensors that exist after a step: model.parameters() lists a tied weight once."""
    parameters = list(model.parameters())
    state = [t for p in parameters for t in optimizer.state[p].values() if torch.is_tensor(t)]
    return {
        "parameters": sum(tensor_bytes(p) for p in parameters),
        "gradients": sum(tensor_bytes(p.grad) for p in parameters if p.grad is not None),
        "optimizer_state": sum(tensor_bytes(t) for t in state),
    }


def tensor_bytes(tensor):
    return tensor.numel() * tensor.element_size()


def activation_bytes(model, batch_size, seq_length, dtype):
    """(bytes per token, bytes independent of the token count) of what autograd saves for backward, other
    than the parameters themselves: measured at seq_length and at 2 * seq_length, a line through both."""
    totals = [saved_bytes(model, batch_size, length, dtype) for length in (seq_length, 2 * seq_length)]
    per_token = (totals[1] - totals[0]) / (batch_size * seq_length)
    return per_token, totals[0] - per_token * batch_size * seq_length


def saved_bytes(model, batch_size, seq_length, dtype):
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(tensor):
        # Several saved tensors can be views of one storage: count each storage once.
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    batch = torch.randint(0, model.config.vocab_size, (batch_size, seq_length + 1))
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bfloat16")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), autocast:
        logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def format_per_rank(num_params, world_size):
    """Weights, gradients and AdamW state per GPU under each chapter (16 bytes a parameter in fp32), before
    activations and the weights FSDP gathers for the blocks in flight. Tensor parallelism stays within a node
    (8 GPUs at most); the few replicated norm weights are left out."""
    tp = min(world_size, 8)
    rows = [
        ("01 one GPU", "whole", 16),
        (f"02 DDP, {world_size} GPUs", "whole on every GPU", 16),
        (f"04 FSDP, {world_size} GPUs", f"1/{world_size} on each GPU", 16 / world_size),
        (f"05 FSDP + CPU offload, {world_size} GPUs", f"1/{world_size} per GPU in CPU memory", 0),
        (f"06 tensor parallel, {tp} GPUs", f"1/{tp} on each GPU", 16 / tp),
    ]
    if world_size > tp and world_size % tp == 0:
        rows.append((f"07 FSDP {world_size // tp} x TP {tp}", f"1/{world_size} on each GPU", 16 / world_size))
    lines = [f"weights + gradients + AdamW state per GPU, {num_params:,.0f} parameters (fp32):", "",
             "| chapter | the state | bytes per parameter on a GPU | GB per GPU |", "|---|---|---|---|"]
    lines += [f"| {name} | {held} | {per_param:.3g} | {per_param * num_params / 1e9:,.1f} |"
              for name, held, per_param in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
