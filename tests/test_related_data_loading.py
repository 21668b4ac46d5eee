"""related-topics/data-loading: tokenize_once.py on 2 ranks tokenizes once (one writer on the node) and both
ranks map the same tokens; those tokens, cut into rows, are exactly what tokenizing the documents on the fly
gives."""
import re

import numpy as np
import pytest
import transformers

import launching
from conftest import ROOT, offline_env, record_launch, wait_or_fail
from launching import load_script

SCRIPT = ROOT / "related-topics" / "data-loading" / "tokenize_once.py"
SEQ_LENGTH = 32


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, tiny_dataset):
    """One launch of tokenize_once.py under torchrun with 2 processes on one node."""
    tmp_path = tmp_path_factory.mktemp("tokenize-once")
    args = ["-d", tiny_dataset, "--cache-dir", tmp_path / "cache", "-s", SEQ_LENGTH, "--max-steps", 2]
    process = launching.start([*launching.command(SCRIPT, 2), *args], tmp_path, offline_env(tmp_path))
    [(returncode, stdout, stderr)] = wait_or_fail([process], 120, "tokenize_once.py")
    assert returncode == 0, f"{stdout[-3000:]}\n{stderr[-3000:]}"
    record_launch(SCRIPT, 2, args)
    return stdout, tmp_path / "cache"


def test_one_rank_per_node_tokenizes_and_both_ranks_map_the_same_tokens(two_ranks):
    stdout, cache = two_ranks
    assert re.findall(r"^rank (\d+): tokenized", stdout, re.MULTILINE) == ["0"]
    mapped = dict(re.findall(r"^rank (\d+): mapped (.*)$", stdout, re.MULTILINE))
    assert sorted(mapped) == ["0", "1"] and mapped["0"] == mapped["1"], stdout
    # one finished file (and its description), nothing half-written left behind
    assert sorted(path.suffix for path in cache.iterdir()) == [".bin", ".json"]
    assert len(re.findall(r"^rank \d: read 2 batches of \(8, 33\)", stdout, re.MULTILINE)) == 2


def test_memmap_rows_are_exactly_the_tokens_of_on_the_fly_tokenization(two_ranks, tiny_dataset):
    _, cache = two_ranks
    script = load_script(SCRIPT)
    tokens = script["open_token_file"](str(next(cache.glob("*.bin"))))
    assert tokens.dtype == np.uint16

    # on the fly, here: each document (a line of each file, files in name order) tokenized alone, EOS after it
    tokenizer = transformers.ByT5Tokenizer(extra_ids=0)
    stream = []
    for file in sorted(tiny_dataset.glob("*.txt")):
        for line in file.read_text().splitlines():
            stream += tokenizer(line)["input_ids"]
    assert tokenizer.eos_token_id == stream[-1]
    np.testing.assert_array_equal(tokens, np.array(stream))

    rows = script["TokenRows"](tokens, SEQ_LENGTH + 1)
    assert len(rows) == len(stream) // (SEQ_LENGTH + 1)
    for index in (0, 1, len(rows) - 1):
        assert rows[index].tolist() == stream[index * (SEQ_LENGTH + 1) : (index + 1) * (SEQ_LENGTH + 1)]
