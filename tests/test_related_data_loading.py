"""related-topics/data-loading: tokenize_once.py on 2 ranks tokenizes once (one writer on the node) and both
ranks map the same tokens; those tokens, cut into rows, are exactly what tokenizing the documents on the fly
gives."""
import re
import runpy
import subprocess
import sys

import numpy as np
import pytest
import transformers

from conftest import ROOT, offline_env, record_launch

SCRIPT = ROOT / "related-topics" / "data-loading" / "tokenize_once.py"
SEQ_LENGTH = 32


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, tiny_dataset):
    """One launch of tokenize_once.py under torchrun with 2 processes on one node."""
    tmp_path = tmp_path_factory.mktemp("tokenize-once")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(SCRIPT), "-d", str(tiny_dataset), "--cache-dir", str(tmp_path / "cache"),
               "-s", str(SEQ_LENGTH), "--max-steps", "2"]
    done = subprocess.run(command, cwd=tmp_path, env=offline_env(tmp_path), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    record_launch(SCRIPT, 2, command[6:])
    return done, tmp_path / "cache"


def test_one_rank_per_node_tokenizes_and_both_ranks_map_the_same_tokens(two_ranks):
    done, cache = two_ranks
    assert re.findall(r"^rank (\d+): tokenized", done.stdout, re.MULTILINE) == ["0"]
    mapped = dict(re.findall(r"^rank (\d+): mapped (.*)$", done.stdout, re.MULTILINE))
    assert sorted(mapped) == ["0", "1"] and mapped["0"] == mapped["1"], done.stdout
    # one finished file (and its description), nothing half-written left behind
    assert sorted(path.suffix for path in cache.iterdir()) == [".bin", ".json"]
    assert len(re.findall(r"^rank \d: read 2 batches of \(8, 33\)", done.stdout, re.MULTILINE)) == 2


def test_memmap_rows_are_exactly_the_tokens_of_on_the_fly_tokenization(two_ranks, tiny_dataset):
    _, cache = two_ranks
    script = runpy.run_path(str(SCRIPT))
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
