"""Convert chapter 04's sharded checkpoints (DCP) to one torch.save file or a Hugging Face folder, and back.

    python convert_checkpoint.py dcp-to-hf CHECKPOINT OUT_DIR [-m MODEL]    # -> from_pretrained(OUT_DIR)
    python convert_checkpoint.py dcp-to-torch CHECKPOINT OUT_FILE            # -> torch.load(OUT_FILE)
    python convert_checkpoint.py hf-to-dcp HF_DIR OUT_DIR                    # -> dcp.load(..., OUT_DIR)

CHECKPOINT is a checkpoints/step-N folder written by chapter 04 (one .distcp file per rank and a .metadata
index). -m is the model the checkpoint was trained as (a Hub id or a folder with config.json and a tokenizer;
default: the chapters' tiny Llama), since a DCP checkpoint holds tensors, not the config or the tokenizer.
Runs in one process on CPU and holds the whole model (4 bytes a parameter in fp32) in memory.
"""
import argparse
import os
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
import transformers
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata


def main():
    args = get_parser().parse_args()
    # One process and no process group, on purpose: DCP reads every rank's shards itself.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    if os.path.exists(args.output):
        sys.exit(f"error: {args.output!r} already exists; pass a new path (nothing is overwritten)")
    if args.command == "dcp-to-hf":
        weights = load_model_weights(args.source)
        model, tokenizer = build_hf_model(args.model_name, weights, args.source)
        model.save_pretrained(args.output)
        tokenizer.save_pretrained(args.output)
    elif args.command == "dcp-to-torch":
        check_dcp_checkpoint(args.source)
        # Every entry, model and optimizer, gathered into one nested dict: {"model": ..., "optimizer": ...}.
        dcp_to_torch_save(args.source, args.output)
    else:
        model = load_hf_model(args.source)
        # NOTE: the keys chapter 04 saves under: "model" + the model's own state dict names, so its load (on
        # any number of ranks) finds each tensor. An HF folder has no optimizer state, schedule or data
        # position: this is the model part of a checkpoint only.
        dcp.save({"model": model.state_dict()}, checkpoint_id=args.output)
    print(f"wrote {args.output}")


def get_parser():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=["dcp-to-hf", "dcp-to-torch", "hf-to-dcp"])
    parser.add_argument("source", help="a DCP checkpoint folder (dcp-to-*) or a Hugging Face model folder")
    parser.add_argument("output", help="the folder (or, for dcp-to-torch, the file) to write; must not exist")
    parser.add_argument("-m", "--model-name", default=None,
                        help="dcp-to-hf: the model the checkpoint was trained as (default: the tiny Llama)")
    return parser


def check_dcp_checkpoint(path):
    if not os.path.isfile(os.path.join(path, ".metadata")):
        sys.exit(f"error: {path!r} is not a DCP checkpoint (no .metadata file in it); pass a "
                 "checkpoints/step-N folder written by chapter 04")


def load_model_weights(checkpoint):
    """The whole tensors under "model." in a DCP checkpoint, by their Hugging Face names, in one process."""
    check_dcp_checkpoint(checkpoint)
    metadata = dcp.FileSystemReader(checkpoint).read_metadata()
    # NOTE: the metadata knows every tensor's full shape, whatever the number of ranks that wrote it: empty
    # full-size tensors are what dcp.load fills in one process (no process group), shard by shard.
    entries = {key: value for key, value in metadata.state_dict_metadata.items()
               if key.startswith("model.") and isinstance(value, TensorStorageMetadata)}
    if not entries:
        sys.exit(f"error: {checkpoint!r} holds no model weights (no 'model.' entries); pass a checkpoint "
                 "written by chapter 04")
    state = {"model": {key.removeprefix("model."): torch.empty(value.size, dtype=value.properties.dtype)
                       for key, value in entries.items()}}
    dcp.load(state, checkpoint_id=checkpoint)
    return state["model"]


def build_hf_model(model_name, weights, checkpoint):
    """The model named by -m (or the tiny Llama) holding the checkpoint's weights, and its tokenizer."""
    if model_name is None:
        config, tokenizer = tiny_llama_config(), transformers.ByT5Tokenizer(extra_ids=0)
    else:
        try:
            config = transformers.AutoConfig.from_pretrained(model_name)
            tokenizer = transformers.AutoTokenizer.from_pretrained(model_name)
        except Exception as error:
            sys.exit(f"error: cannot load model {model_name!r} ({one_line(error)}); pass the -m the "
                     "checkpoint was trained with: a Hugging Face model id or a folder with config.json "
                     "and a tokenizer")
    # On the meta device the model allocates nothing; assign=True then makes the loaded tensors its weights.
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    expected = {name: list(tensor.shape) for name, tensor in model.state_dict().items()}
    found = {name: list(tensor.shape) for name, tensor in weights.items()}
    if expected != found:
        name = next(n for n in sorted(set(expected) | set(found)) if expected.get(n) != found.get(n))
        sys.exit(f"error: checkpoint {checkpoint!r} holds a different model than "
                 f"{model_name or 'the tiny Llama'} ({name}: {found.get(name)} in the checkpoint, "
                 f"{expected.get(name)} in the model); pass the -m it was trained with")
    model.load_state_dict(weights, assign=True)
    # A tied head and embedding are one tensor under two names; after assign they are two: tie them again.
    model.tie_weights()
    return model, tokenizer


def load_hf_model(path):
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except Exception as error:
        sys.exit(f"error: cannot load a Hugging Face model from {path!r} ({one_line(error)}); pass a "
                 "folder with config.json and *.safetensors, such as the hf/ folder a chapter exports")


def tiny_llama_config():
    # The chapters' default model (chapter 04's tiny_llama_config): what `train_llm.py` trains without -m.
    return transformers.LlamaConfig(
        vocab_size=272, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=1024, bos_token_id=None, eos_token_id=1, pad_token_id=0,
    )


def one_line(error):
    """The error's message as one line: some libraries spread it over several, with the cause on the last."""
    return " ".join(str(error).split()) or type(error).__name__


if __name__ == "__main__":
    main()
