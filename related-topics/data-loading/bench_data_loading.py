"""How fast can this machine feed training? Tokens per second of each way to get a batch of token ids.

    python bench_data_loading.py                      # built-in corpus, 200 batches of 8 x 129 a DataLoader
    python bench_data_loading.py -b 16 -s 1024 --max-steps 100

Measures: tokenizing on the fly (ByT5, the chapters' byte tokenizer, in Python; and a byte-level BPE trained
here, in Rust, like the tokenizers of real models), reading rows of a memory-mapped file of token ids, and a
DataLoader over either with 0 and with 2 worker processes. With CUDA it also times the copy of a batch to the
GPU from ordinary and from pinned memory; without, it says so. Prints a markdown table and writes it to
<save-dir>/data_loading.md.
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import transformers


def main():
    args = get_parser().parse_args()
    torch.set_num_threads(1)
    documents = corpus(args.documents)
    row_length = args.seq_length + 1
    results = []

    # The BPE has a 1024-token vocabulary, trained on the corpus itself: the fast tokenizers of Llama or
    # Qwen are this kind of object (transformers over the Rust tokenizers library).
    tokenizers = {
        "ByT5 (Python)": transformers.ByT5Tokenizer(extra_ids=0),
        "byte-level BPE (Rust)": transformers.GPT2Tokenizer().train_new_from_iterator(
            documents, vocab_size=1024
        ),
    }
    text_bytes = sum(len(document.encode()) for document in documents)
    for name, tokenizer in tokenizers.items():
        start = time.perf_counter()
        stream = tokenize_and_join(documents, tokenizer)
        seconds = time.perf_counter() - start
        results.append((f"tokenize on the fly: {name}", len(stream) / seconds, None,
                        f"{text_bytes / seconds / 1e6:.2f} MB of text/s, "
                        f"{text_bytes / len(stream):.2f} bytes a token"))

    os.makedirs(args.save_dir, exist_ok=True)
    path = os.path.join(args.save_dir, "tokens.bin")
    np.array(tokenize_and_join(documents, tokenizers["ByT5 (Python)"]), dtype=np.uint16).tofile(path)
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    rows = TokenRows(tokens, row_length)
    order = np.random.default_rng(0).permutation(len(rows))
    num_rows = min(len(rows), args.max_steps * args.batch_size)
    start = time.perf_counter()
    for i in order[:num_rows]:
        rows[i]
    results.append(("read rows of a memmap (np.memmap, uint16)", num_rows * row_length
                    / (time.perf_counter() - start), None, f"{num_rows} random rows, from the page cache"))

    for workers in (0, 2):
        memmap_loader = torch.utils.data.DataLoader(rows, batch_size=args.batch_size, shuffle=True,
                                                    num_workers=workers)
        results.append((f"DataLoader over the memmap, {workers} workers", *loader_speed(memmap_loader, args),
                        "shuffled rows"))
        on_the_fly = OnTheFlyRows(documents, tokenizers["ByT5 (Python)"], row_length)
        fly_loader = torch.utils.data.DataLoader(on_the_fly, batch_size=args.batch_size, num_workers=workers)
        results.append((f"DataLoader tokenizing on the fly (ByT5), {workers} workers",
                        *loader_speed(fly_loader, args), "documents in order"))

    if torch.cuda.is_available():
        for pinned in (False, True):
            results.append((f"copy a batch to the GPU, {'pinned' if pinned else 'ordinary'} memory",
                            copy_speed(args, row_length, pinned), None,
                            "non_blocking=True, then synchronize"))
    else:
        results.append(("copy a batch to the GPU, pinned or ordinary memory", None, None,
                        "not measured: no CUDA device here"))

    lines = [f"-b {args.batch_size}, -s {args.seq_length}, {len(documents)} documents, "
             f"{len(tokens):,} tokens (ByT5), one thread a process", "",
             "| path | tokens/s | first batch (s) | what |", "|---|---|---|---|"]
    lines += [f"| {name} | {'n/a' if speed is None else f'{speed:,.0f}'} | "
              f"{'' if first is None else f'{first:.3f}'} | {what} |" for name, speed, first, what in results]
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(args.save_dir, "data_loading.md"), "w") as f:
        f.write(table + "\n")


def get_parser():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-b", "--batch-size", type=positive_int, default=8)
    parser.add_argument("-s", "--seq-length", type=positive_int, default=128)
    parser.add_argument("--documents", type=positive_int, default=4000, help="size of the built-in corpus")
    parser.add_argument("--max-steps", type=positive_int, default=200,
                        help="batches per DataLoader measurement")
    parser.add_argument("--save-dir", default="outputs/bench", help="where tokens.bin and the table go")
    return parser


def positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def corpus(num_documents, seed=1234):
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


def tokenize_and_join(documents, tokenizer):
    """Token ids of all documents with EOS after each, as one list (the chapters' packing, before the cut)."""
    eos = tokenizer.eos_token_id
    stream = []
    for start in range(0, len(documents), 1000):
        for ids in tokenizer(documents[start : start + 1000])["input_ids"]:
            stream.extend(ids)
            if eos is not None and (not ids or ids[-1] != eos):
                stream.append(eos)
    return stream


class TokenRows(torch.utils.data.Dataset):
    def __init__(self, tokens, length):
        self.tokens, self.length = tokens, length

    def __len__(self):
        return len(self.tokens) // self.length

    def __getitem__(self, index):
        return torch.from_numpy(self.tokens[index * self.length : (index + 1) * self.length].astype(np.int64))


class OnTheFlyRows(torch.utils.data.IterableDataset):
    """Tokenizes documents as batches are asked for and yields packed rows.

    NOTE: each DataLoader worker runs its own copy of __iter__: without the split by worker below, 2 workers
    would yield every row twice."""

    def __init__(self, documents, tokenizer, length):
        self.documents, self.tokenizer, self.length = documents, tokenizer, length

    def __iter__(self):
        worker = torch.utils.data.get_worker_info()
        documents = self.documents if worker is None else self.documents[worker.id :: worker.num_workers]
        buffer = []
        for start in range(0, len(documents), 100):
            buffer += tokenize_and_join(documents[start : start + 100], self.tokenizer)
            while len(buffer) >= self.length:
                yield torch.tensor(buffer[: self.length])
                buffer = buffer[self.length :]


def loader_speed(loader, args):
    """(tokens/s after the first batch, seconds to the first batch): starting workers costs once per epoch."""
    start, tokens = time.perf_counter(), 0
    for step, batch in enumerate(loader, 1):
        if step == 1:
            first_batch, start = time.perf_counter() - start, time.perf_counter()
        else:
            tokens += batch.numel()
        if step == args.max_steps + 1:
            break
    return tokens / (time.perf_counter() - start), first_batch


def copy_speed(args, row_length, pinned, repeats=100):
    batch = torch.randint(0, 256, (args.batch_size, row_length))
    if pinned:
        batch = batch.pin_memory()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        batch.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    return repeats * batch.numel() / (time.perf_counter() - start)


if __name__ == "__main__":
    main()
