"""Tokenize a corpus once per node into a memory-mapped file of token ids, then read batches of it on every
rank.

    torchrun --nproc_per_node=2 tokenize_once.py             # built-in corpus, cache in outputs/token-cache
    torchrun --nproc_per_node=8 tokenize_once.py -d corpus/ -m meta-llama/Llama-3.2-1B --cache-dir /nvme/cache

On each node the process with LOCAL_RANK 0 tokenizes every document, puts EOS after each, and writes the token
ids as one flat array to <cache-dir>/<key>.bin, where the key names the data and the tokenizer; the other
processes wait at a barrier and then map the same file. With --shared-cache (a folder every node sees: NFS,
Lustre) only global rank 0 writes. A launch that finds the file tokenizes nothing. Then every rank reads
--max-steps batches of its own rows through a DataLoader and prints a checksum of the whole array it mapped.
Runs without torchrun too (one process).
"""
import argparse
import hashlib
import json
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist
import transformers


def main():
    args = get_parser().parse_args()
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if world_size > 1:
        # nccl's object collectives run on the current GPU, so each process must pick its own first.
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    tokenizer = load_tokenizer(args.model_name)
    files = document_files(args.dataset) if args.dataset else []
    cache_dir = args.cache_dir or os.path.join(args.save_dir, "token-cache")
    path = os.path.join(cache_dir, cache_key(files, tokenizer) + ".bin")

    # NOTE: node-local storage (/tmp, a local NVMe) needs one writer per node, since the other nodes do not
    # see the file; a shared file system needs one writer in all, or the nodes would race on one file.
    writer = rank == 0 if args.shared_cache else local_rank == 0
    error = None
    if writer and not os.path.exists(path):
        try:
            documents = read_documents(files) if files else builtin_corpus()
            num_tokens = write_token_file(path, documents, tokenizer)
            say(f"rank {rank}: tokenized {len(documents)} documents into {num_tokens} tokens in {path}")
        except (OSError, ValueError) as failure:
            error = f"error: rank {rank} cannot tokenize into {path}: {failure}"
    # NOTE: the all-gather is the barrier: readers go on once every writer has renamed its finished file into
    # place, and if a writer failed, every rank exits with its line instead of waiting for it.
    if world_size > 1:
        errors = [None] * world_size
        dist.all_gather_object(errors, error)
        error = next((line for line in errors if line), None)
    if error:
        sys.exit(error)
    tokens = open_token_file(path)
    checksum = hashlib.sha256(np.ascontiguousarray(tokens).tobytes()).hexdigest()[:16]
    say(f"rank {rank}: mapped {path}: {len(tokens)} tokens, sha256 {checksum}")

    rows = TokenRows(tokens, args.seq_length + 1)
    if len(rows) < world_size:
        sys.exit(f"error: {len(tokens)} tokens give {len(rows)} rows of {args.seq_length + 1}, fewer than "
                 "one per rank; use more data or a smaller -s")
    sampler = torch.utils.data.DistributedSampler(rows, num_replicas=world_size, rank=rank, seed=0)
    loader = torch.utils.data.DataLoader(
        rows, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers,
        pin_memory=torch.cuda.is_available(),
    )
    batches = 0
    for batch in loader:
        batches += 1
        if batches == args.max_steps:
            break
    say(f"rank {rank}: read {batches} batches of {tuple(batch.shape)} from {len(rows)} rows")
    if world_size > 1:
        dist.destroy_process_group()


def get_parser():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-d", "--dataset", default=None,
                        help="a .txt file or a folder of them, a document a line (default: built-in corpus)")
    parser.add_argument("-m", "--model-name", default=None,
                        help="whose tokenizer: a Hub id or a folder (default: ByT5's bytes, as chapter 01)")
    parser.add_argument("--cache-dir", default=None,
                        help="where the token file goes (default: <save-dir>/token-cache)")
    parser.add_argument("--shared-cache", action="store_true",
                        help="the cache folder is on storage every node sees: only global rank 0 tokenizes")
    parser.add_argument("-s", "--seq-length", type=positive_int, default=128)
    parser.add_argument("-b", "--batch-size", type=positive_int, default=8)
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--max-steps", type=positive_int, default=10, help="batches each rank reads")
    parser.add_argument("--save-dir", default="outputs")
    return parser


def say(line):
    # One write with its newline: with print, the text and the newline are two writes, and two ranks' lines
    # on one stream can interleave.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def load_tokenizer(model_name):
    if model_name is None:
        return transformers.ByT5Tokenizer(extra_ids=0)
    try:
        return transformers.AutoTokenizer.from_pretrained(model_name)
    except Exception as error:
        sys.exit(f"error: cannot load the tokenizer of {model_name!r} ({str(error).strip().splitlines()[0]})")


def document_files(dataset):
    if os.path.isdir(dataset):
        files = sorted(os.path.join(dataset, name) for name in os.listdir(dataset) if name.endswith(".txt"))
    else:
        files = [dataset] if dataset.endswith(".txt") and os.path.isfile(dataset) else []
    if not files:
        sys.exit(f"error: {dataset!r} is neither a .txt file nor a folder with .txt files")
    return files


def cache_key(files, tokenizer):
    """Names the data (each file's path, size and modification time, as datasets' cache does for local files)
    and the tokenizer (its class, name and vocabulary size): any change makes a new file."""
    parts = [type(tokenizer).__name__, tokenizer.name_or_path, len(tokenizer)]
    parts += [(os.path.abspath(f), os.path.getsize(f), os.path.getmtime(f)) for f in files] or ["builtin"]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def read_documents(files):
    documents = []
    for file in files:
        with open(file, encoding="utf-8") as f:
            documents += [line.rstrip("\n") for line in f if line.strip()]
    return documents


def builtin_corpus(num_documents=4000, seed=1234):
    rng = random.Random(seed)
    names = ["Ada", "Ben", "Cleo", "Dev", "Eva", "Finn", "Gia", "Hugo"]
    things = ["apples", "books", "coins", "shells"]
    documents = []
    for _ in range(num_documents):
        giver, taker = rng.sample(names, 2)
        thing, had, given = rng.choice(things), rng.randint(1, 20), rng.randint(1, 20)
        documents.append(f"{taker} has {had} {thing}. {giver} gives {taker} {given} more. "
                         f"Now {taker} has {had + given} {thing}.")
    return documents


def write_token_file(path, documents, tokenizer):
    """Token ids of all documents, EOS after each, as one flat array; returns its length. Written under a
    temporary name and renamed when complete, so a reader never maps half a file."""
    eos = tokenizer.eos_token_id
    stream = []
    for start in range(0, len(documents), 1000):
        for ids in tokenizer(documents[start : start + 1000])["input_ids"]:
            stream.extend(ids)
            if eos is not None and (not ids or ids[-1] != eos):
                stream.append(eos)
    if not stream:
        raise ValueError("the documents hold no text")
    # 2 bytes a token while the vocabulary fits (Llama 3's 128k ids do not: 4 bytes).
    dtype = np.uint16 if len(tokenizer) <= 2**16 else np.uint32
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".json", "w") as f:
        json.dump({"dtype": np.dtype(dtype).name, "num_tokens": len(stream)}, f)
    partial = f"{path}.partial-{os.getpid()}"
    np.array(stream, dtype=dtype).tofile(partial)
    os.replace(partial, path)
    return len(stream)


def open_token_file(path):
    with open(path + ".json") as f:
        meta = json.load(f)
    return np.memmap(path, dtype=meta["dtype"], mode="r", shape=(meta["num_tokens"],))


class TokenRows(torch.utils.data.Dataset):
    """Row i is tokens[i * length : (i + 1) * length]: the chapters' packing, read from the page cache, with
    no tokenizer in the loop."""

    def __init__(self, tokens, length):
        self.tokens, self.length = tokens, length

    def __len__(self):
        return len(self.tokens) // self.length

    def __getitem__(self, index):
        row = self.tokens[index * self.length : (index + 1) * self.length]
        return torch.from_numpy(row.astype(np.int64))


if __name__ == "__main__":
    main()
