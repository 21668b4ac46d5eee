"""Compile each transformer block of a Hugging Face Llama on its own (torchtitan's way), or the whole model,
and count the graphs TorchDynamo compiled and the recompilations it needed.

    python compile_per_block.py                      # 10 blocks compiled one by one
    python compile_per_block.py --whole              # the whole model, as the chapters' --compile does

A per-block compile that works compiles one graph and reuses it for every block; one that guards on each
block's own attributes recompiles once per block, and past torch._dynamo.config.recompile_limit (8) runs
the remaining blocks eagerly. Prints the counts and writes them to <save-dir>/compile_per_block.json.
"""
import argparse
import json
import os
import time

import torch
import torch._dynamo.utils
import transformers


def main():
    args = get_parser().parse_args()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=272, hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    if args.whole:
        model.compile(backend=args.backend)
    else:
        for block in model.model.layers:
            block.compile(backend=args.backend)

    start = time.perf_counter()
    for _ in range(args.max_steps):
        batch = torch.randint(0, config.vocab_size, (2, 33))
        model(input_ids=batch, use_cache=False).logits.sum().backward()
    counts = {
        "compiled": "whole model" if args.whole else f"each of {args.layers} blocks",
        # Every compilation of a frame counts, recompilations included: one per block if guards fail.
        "compilations": torch._dynamo.utils.counters["frames"]["total"],
        "unique_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
        "seconds_for_all_steps": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(counts))
    os.makedirs(args.save_dir, exist_ok=True)
    with open(os.path.join(args.save_dir, "compile_per_block.json"), "w") as f:
        json.dump(counts, f)


def get_parser():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=10, help="more than recompile_limit (8)")
    parser.add_argument("--whole", action="store_true", help="compile the whole model instead")
    parser.add_argument("--backend", default="aot_eager",
                        help="aot_eager traces like inductor but generates no kernels: seconds, not minutes")
    parser.add_argument("--max-steps", type=int, default=3, help="forward + backward passes")
    parser.add_argument("--save-dir", default="outputs")
    return parser


if __name__ == "__main__":
    main()
