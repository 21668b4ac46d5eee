"""Fetch a model's safetensors weights, config and tokenizer files into a folder, and nothing else.

    python download_model.py meta-llama/Llama-3.1-405B /local/models/Llama-3.1-405B     # on every node
    python download_model.py meta-llama/Llama-3.1-405B /shared/models/Llama-3.1-405B    # once, shared

Builds no model and loads no weights: a 405B download needs disk (812 GB in bf16), not memory. Leaves out
the other copies many repositories hold (original/*.pth, *.bin, GGUF), which would double the download.
Interrupted, it resumes where it stopped. Gated models need `hf auth login` first (or HF_TOKEN).
"""
import argparse
import sys

from huggingface_hub import snapshot_download

# What train_llm.py reads: config.json, the tokenizer's files, and the safetensors shards with their index.
ALLOW_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                  "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="Hugging Face model id, e.g. meta-llama/Llama-3.1-405B")
    parser.add_argument("folder", help="where the files go: node-local disk, or a filesystem all nodes share")
    parser.add_argument("--revision", default=None, help="a branch, tag or commit (default: main)")
    args = parser.parse_args()
    try:
        # NOTE: "*.safetensors" matches in subfolders too; Llama 3.1's original/ holds only .pth files.
        path = snapshot_download(args.model, revision=args.revision, local_dir=args.folder,
                                 allow_patterns=ALLOW_PATTERNS, max_workers=16)
    except Exception as error:
        sys.exit(f"error: cannot download {args.model!r}: {str(error).strip().splitlines()[0]}")
    print(f"{args.model} is in {path}: pass -m {path} --from-pretrained to train_llm.py")


if __name__ == "__main__":
    main()
