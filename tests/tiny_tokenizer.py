"""A byte tokenizer built offline in its fast form (a tokenizer.json): transformers 5 loads a Mixtral's or a
Granite's tokenizer only from one. Plain Python, no pytest: docs/loss_parity.py imports it too."""


def byte_level_tokenizer():
    """A fast tokenizer with one token per byte after 3 special tokens, as ByT5's (which has no fast one)."""
    import tokenizers
    import transformers

    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{char: i + 3 for i, char in enumerate(alphabet)}}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
