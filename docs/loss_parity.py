"""Train the same model with every chapter and plot the per-step losses on top of each other.

    python docs/loss_parity.py            # about 10 minutes on a 2-core CPU; writes docs/loss-parity.png

Every chapter starts from the same saved weights (--from-pretrained), trains in fp32 on the built-in corpus
with the same global batch of 8 sequences: one process at -b 8 (chapter 01), 2 ranks at -b 4 (DDP, FSDP), 2
ranks at -b 8 (tensor parallelism and pipeline stages, where both ranks see the whole batch), 4 ranks as 2 x 2
(2D at -b 4, 3D as 2 stages of 2 TP ranks at -b 8, context parallelism as 2 dp ranks of 2 cp ranks at -b 4).
Chapter 11 trains mixtures of experts only: it and chapter 01 also train a tiny Mixtral (8 experts, top-2), at
4 ranks as 2 edp x 2 ep at -b 2 without the load-balancing loss. The upper panel shows the losses, the lower
one each run's difference from chapter 01 on the same model, which stays at rounding level (about 1e-6).
"""
import argparse
import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from tiny_tokenizer import byte_level_tokenizer  # noqa: E402
# run: (chapter folder, processes, -b, more flags, model)
RUNS = {
    "01-single-gpu": ("01-single-gpu", None, 8, [], "llama"),
    "02-distributed-data-parallel": ("02-distributed-data-parallel", 2, 4, [], "llama"),
    "04-fully-sharded-data-parallel": ("04-fully-sharded-data-parallel", 2, 4, [], "llama"),
    "06-tensor-parallel": ("06-tensor-parallel", 2, 8, [], "llama"),
    "07-2d-parallel": ("07-2d-parallel", 4, 4, ["--tp", "2"], "llama"),
    "08-pipeline-parallel": ("08-pipeline-parallel", 2, 8, [], "llama"),
    "09-3d-parallel": ("09-3d-parallel", 4, 8, ["--pp", "2", "--tp", "2"], "llama"),
    "10-context-parallel": ("10-context-parallel", 4, 4, ["--cp", "2"], "llama"),
    "01-single-gpu, Mixtral": ("01-single-gpu", None, 8, [], "mixtral"),
    "11-expert-parallel, Mixtral": ("11-expert-parallel", 4, 2, ["--ep", "2", "--aux-loss-coef", "0"], "mixtral"),
}
# the run each one is compared with: chapter 01 on the same model
REFERENCE = {"llama": "01-single-gpu", "mixtral": "01-single-gpu, Mixtral"}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("loss-parity.png"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        models = {"llama": save_tiny_model(work / "tiny-llama", transformers.LlamaConfig,
                                           transformers.ByT5Tokenizer(extra_ids=0)),
                  # (transformers 5 loads a Mixtral's tokenizer only in its fast form)
                  "mixtral": save_tiny_model(work / "tiny-mixtral", transformers.MixtralConfig,
                                             byte_level_tokenizer(), num_local_experts=8, num_experts_per_tok=2)}
        losses = {name: train(name, models, work, args.steps) for name in RUNS}
    plot(losses, args.out)
    worst = max(abs(a - b) for name in RUNS for a, b in zip(losses[name], losses[reference(name)]))
    print(f"wrote {args.out}; largest difference from chapter 01: {worst:.1e}")


def save_tiny_model(folder, config_class, tokenizer, **more):
    """Chapter 01's default tiny Llama's shape (or a Mixtral of it) with fixed random weights, saved as a Hugging
    Face checkpoint."""
    torch.manual_seed(0)
    config = config_class(
        vocab_size=272, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=1024, bos_token_id=None, eos_token_id=1, pad_token_id=0,
        **more,
    )
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def reference(name):
    return REFERENCE[RUNS[name][4]]


def train(name, models, work, steps):
    chapter, nproc, batch_size, flags, model = RUNS[name]
    launcher = [sys.executable] if nproc is None else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"
    ]
    command = [*launcher, str(ROOT / chapter / "train_llm.py"), "-m", str(models[model]), "--from-pretrained",
               "--dtype", "float32", "-b", str(batch_size), "--max-steps", str(steps), "--log-freq", "1",
               "--save-dir", str(work), "-e", name.replace(", ", "-"), *flags]
    print(" ".join(command[1:]), flush=True)
    subprocess.run(command, check=True, cwd=work, capture_output=True)
    lines = (work / name.replace(", ", "-") / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def plot(losses, out):
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=[2, 1])
    for (name, values), style in zip(losses.items(), itertools.cycle(["-", "--", ":", "-."])):
        steps = range(1, len(values) + 1)
        top.plot(steps, values, style, label=name, linewidth=1.5)
        bottom.plot(steps, [a - b for a, b in zip(values, losses[reference(name)])], style, label=name)
    top.set_ylabel("loss (nats per token)")
    top.set_title("Same model, same global batch: every chapter trains to the same losses")
    top.legend()
    bottom.set_ylabel("difference from 01\n(same model)")
    bottom.set_xlabel("step")
    bottom.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    figure.tight_layout()
    figure.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
