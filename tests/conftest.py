"""Shared test harness: a tiny model and dataset built on disk, and one helper that launches a chapter.

Every chapter test goes through `run_chapter`, which starts the chapter's script the way a reader does
(`python train_llm.py` for chapter 01, `torchrun --standalone --nproc_per_node N train_llm.py` after), with a
timeout, a free port (torchrun's --standalone picks one), a temp dir, and offline Hugging Face and wandb.
"""
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import random
import re
import resource
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

import launching
from tiny_tokenizer import byte_level_tokenizer

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = {
    "01": ROOT / "01-single-gpu",
    "02": ROOT / "02-distributed-data-parallel",
    "03": ROOT / "03-job-launchers",
    "04": ROOT / "04-fully-sharded-data-parallel",
    "05": ROOT / "05-training-llama-405b",
    "06": ROOT / "06-tensor-parallel",
    "07": ROOT / "07-2d-parallel",
    "08": ROOT / "08-pipeline-parallel",
    "09": ROOT / "09-3d-parallel",
    "10": ROOT / "10-context-parallel",
    "11": ROOT / "11-expert-parallel",
}
INJECT = Path(__file__).with_name("inject.py")
PRACTICE = CHAPTERS["03"] / "practice-cluster"
SLURM_TOOLS = ("slurmctld", "slurmd", "sbatch", "srun", "munged", "nsenter", "unshare", "ip")
# NOTE: a tiny Llama whose heads (4), kv heads (4), hidden (64) and vocab (272) divide by 1, 2 and 4 ranks.
TINY_LLAMA = dict(
    vocab_size=272, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, max_position_embeddings=256, bos_token_id=None, eos_token_id=1, pad_token_id=0,
)


def tracked_files(pattern):
    """The repository's files matching a git pathspec such as "*.md", from git's list: not a virtual environment
    or outputs that a run left inside the clone."""
    listed = subprocess.run(["git", "ls-files", pattern], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / name for name in listed.stdout.split()]


@dataclasses.dataclass
class Run:
    """What one launch left behind: exit code, output, and the experiment folder with metrics.jsonl."""

    returncode: int
    stdout: str
    stderr: str
    exp_dir: Path

    @property
    def metrics(self):
        return launching.read_metrics(self.exp_dir / "metrics.jsonl")

    @property
    def losses(self):
        return [m["loss"] for m in self.metrics]

    @property
    def worker_stderr(self):
        """stderr without torchrun's failure summary, which repeats each failed rank's last error line."""
        return worker_stderr(self.stderr)


def pytest_collection_modifyitems(items):
    """The README commands (tests/test_docs.py) run last, after every test that may already have run one."""
    items.sort(key=lambda item: item.originalname == "test_readme_command_runs")


# The test files that bring up the practice cluster (one at a time on a machine: its nodes have fixed names).
CLUSTER_FILES = {"test_03_launchers.py", "test_diagnosing_errors.py", "test_practice_cluster.py"}


def worker_unit(nodeid):
    """What one pytest-xdist worker runs in one go: a test file, so that its module fixtures start once; the
    files that use the practice cluster together; each README's commands apart, in their order (a command may
    use what the one above it wrote), so that both workers share the README commands at the end."""
    if "::test_readme_command_runs[" in nodeid:
        return "README commands: " + nodeid.split("::test_readme_command_runs[")[1].split(": ")[0]
    file = Path(nodeid.split("::")[0]).name
    return "practice cluster" if file in CLUSTER_FILES else file


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile (pytest.ini), by worker_unit instead of by file, in collection order. (Not xdist's
    loadgroup: with pytest 9 it groups nothing, its node id suffix is lost.)"""
    from xdist.scheduler import LoadScopeScheduling

    if config.getvalue("dist") != "loadfile":
        return None

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return worker_unit(nodeid)

    return ByUnit(config, log)


@dataclasses.dataclass
class Launch:
    """A launch that exited 0: the script it ran (the chapter's own under tests/inject.py), its processes (None:
    plain python), its flags, and the test that made it."""

    script: str
    nproc: int | None
    args: list
    test: str


def pytest_configure(config):
    """One record of the session's successful launches (below) and one folder of what is built once
    (built_once), shared by pytest-xdist's workers: they start after this runs in the controller and inherit
    its environment."""
    if not hasattr(config, "workerinput"):
        handle, path = tempfile.mkstemp(prefix="launches-", suffix=".jsonl")
        os.close(handle)
        os.environ["TESTS_LAUNCH_RECORD"] = config.launch_record = path
        os.environ["TESTS_BUILT_ONCE"] = config.built_once = tempfile.mkdtemp(prefix="built-once-")


def pytest_unconfigure(config):
    if hasattr(config, "launch_record"):
        os.remove(config.launch_record)
        shutil.rmtree(config.built_once, ignore_errors=True)


def built_once(name, build):
    """A folder that build(folder) fills once per test session, for every pytest-xdist worker: the first
    worker to ask builds it under a lock while any other that asks waits, then all read it (tiny models,
    reference launches: a launch costs 5-15 s)."""
    folder = Path(os.environ["TESTS_BUILT_ONCE"]) / name
    with open(folder.with_name(name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not folder.with_name(name + ".done").exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed build left
            folder.mkdir()
            build(folder)
            folder.with_name(name + ".done").touch()
    return folder


def record_launch(script, nproc, args):
    """Note a launch that exited 0 (run_chapter does; so do the tests that start a script themselves), for
    tests/test_docs.py, which does not run a README command again that one of them already ran."""
    launch = Launch(str(Path(script).resolve()), nproc, [str(arg) for arg in args],
                    os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0])
    with open(os.environ["TESTS_LAUNCH_RECORD"], "a") as record:
        fcntl.flock(record, fcntl.LOCK_EX)  # whole lines, also from two workers at once
        record.write(json.dumps(dataclasses.asdict(launch)) + "\n")


def successful_launches():
    """Every launch of this session that exited 0 so far, on any worker, in order."""
    with open(os.environ["TESTS_LAUNCH_RECORD"]) as record:
        return [Launch(**json.loads(line)) for line in record]


def worker_stderr(stderr):
    return stderr.split("\nFailures:\n")[0]


def offline_env(tmp_path):
    """Environment for a launch: offline Hugging Face and wandb, caches inside the test's temp dir."""
    env = dict(os.environ)
    env.update(
        HF_HOME=str(tmp_path / "hf-home"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        WANDB_MODE="offline",
        WANDB_DIR=str(tmp_path),
        WANDB_SILENT="true",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def online_env(**env):
    """Additions to offline_env for a launch that is online, as a reader's is: the libraries not offline, the Hub
    (HF_ENDPOINT in env, if given) reached directly even where a proxy is set, no token."""
    return {"HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HTTP_PROXY": "",
            "HTTPS_PROXY": "", "http_proxy": "", "https_proxy": "", "NO_PROXY": "*", "no_proxy": "*",
            "HF_TOKEN": "", **env}


def start_chapter(chapter, args, tmp_path, nproc=None, env=None, experiment="test", script=None, agent=None):
    """Start a chapter's train_llm.py in the background, in a session of its own; returns (Popen, command).

    nproc=None runs `python train_llm.py`; a number runs it under `torchrun --standalone` (a free port), or under
    torchrun with the flags `agent` (a rendezvous of several agents, restarts). The run writes to
    tmp_path/outputs/<experiment>. env adds to (or overrides) offline_env.
    """
    script = script or CHAPTERS[chapter] / "train_llm.py"
    command = launching.command(script, nproc, **({"agent": agent} if agent is not None else {}))
    command += ["--save-dir", str(tmp_path / "outputs"), "-e", experiment, *map(str, args)]
    return launching.start(command, tmp_path, {**offline_env(tmp_path), **(env or {})}), command


def run_chapter(chapter, args, tmp_path, nproc=None, timeout=240, expect_ok=True, env=None,
                experiment="test", script=None):
    """Launch a chapter's train_llm.py (see start_chapter) and wait for it.

    A hang past `timeout` kills the launch and every process it started and fails the test; with expect_ok,
    any non-zero exit (also one after the work is done) fails the test with the output.
    """
    process, command = start_chapter(chapter, args, tmp_path, nproc, env, experiment, script)
    stdout, stderr, how = launching.wait(process, timeout)
    if how == "timed out":
        pytest.fail(f"{' '.join(command)} hung for {timeout} s\n--- stdout\n{stdout[-4000:]}\n"
                    f"--- stderr\n{stderr[-4000:]}")
    run = Run(process.returncode, stdout, stderr, tmp_path / "outputs" / experiment)
    if run.returncode == 0:
        ran = (env or {}).get("INJECT_SCRIPT") if script == INJECT else script
        record_launch(ran or CHAPTERS[chapter] / "train_llm.py", nproc, args)
    if expect_ok and run.returncode != 0:
        pytest.fail(f"{' '.join(command)} exited {run.returncode}\n--- stdout\n{stdout[-4000:]}\n"
                    f"--- stderr\n{stderr[-6000:]}")
    return run


def wait_or_fail(processes, timeout, what):
    """[(returncode, stdout, stderr)] of launches that run together; a hang kills all of them and fails."""
    results = launching.wait_all(processes, timeout)
    if any(how == "timed out" for _, _, how in results):
        outputs = "\n".join(stdout[-2000:] + stderr[-2000:] for stdout, stderr, _ in results)
        pytest.fail(f"{what} hung for {timeout} s\n{outputs}")
    return [(process.returncode, stdout, stderr) for process, (stdout, stderr, _) in zip(processes, results)]


def missing_system_tool(reason):
    """Skip a test that needs a system tool or root (Slurm, mpirun, sshd, py-spy, a tmpfs mount) where it is
    missing, with the reason; in CI (CI=true), where .ci/run installs them all, fail instead: a test that
    quietly stops running proves nothing."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run this test, but: {reason}")
    pytest.skip(reason)


def probe_reports(run, probe):
    """{rank: report} from the "rank r: <probe> {json}" lines of tests/inject.py's probes, wherever such a line
    starts (it can follow another rank's unfinished print)."""
    return {int(rank): json.loads(report) for rank, report in re.findall(rf"rank (\d+): {probe} (\{{.*\}})$",
                                                                         run.stdout, re.MULTILINE)}


def shard_bytes(run):
    """{rank: {"parameters"|"gradients"|"optimizer_state": [bytes on the rank, bytes of the whole model]}} from
    tests/inject.py's shard-bytes probe."""
    return probe_reports(run, "shard_bytes")


@contextlib.contextmanager
def measured():
    """Wall seconds and the CPU seconds of the processes it waited for (torchrun's workers included), of the
    block it wraps. A failure that should come within seconds is bounded by its CPU time: its wall time depends
    on the machine's load (4 s idle, over 80 s measured beside other test suites on 2 cores)."""
    def cpu():
        return sum(resource.getrusage(resource.RUSAGE_CHILDREN)[:2])  # user + system

    cost = {}
    started_wall, started_cpu = time.perf_counter(), cpu()
    yield cost
    cost.update(wall=time.perf_counter() - started_wall, cpu=cpu() - started_cpu)


def inject_env(chapter, what, rank=None, after_step=None):
    """Environment for run_chapter(..., script=INJECT): tests/inject.py runs the chapter's script with one fault
    or probe (see that file)."""
    env = {"INJECT_SCRIPT": str(CHAPTERS[chapter] / "train_llm.py"), "INJECT": what}
    if rank is not None:
        env["INJECT_RANK"] = str(rank)
    if after_step is not None:
        env["INJECT_AFTER_STEP"] = str(after_step)
    return env


def write_tiny_model(path, seed=0, architecture="llama", **overrides):
    """A randomly initialised tiny Llama, Qwen3 (per-head q/k norms), Gemma 2 (no sdpa in transformers: eager
    attention with soft-capped scores), Gemma 3 (also norms around the MLP, a scaled embedding), Granite
    (embeddings, residuals and logits scaled outside the layers; logits x2, not Granite 3's /16, so that it
    learns in a few steps), Mixtral (experts: one tensor each on disk, fused in the model), the MoEs Qwen3-MoE,
    Qwen2-MoE, GPT-OSS and DeepSeek-V3, or GPT-NeoX (not the Llama layout), with a byte tokenizer, saved like
    any Hub checkpoint."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config_class = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config,
                    "gemma2": transformers.Gemma2Config, "mixtral": transformers.MixtralConfig,
                    "gemma3": transformers.Gemma3TextConfig, "granite": transformers.GraniteConfig,
                    "gpt_neox": transformers.GPTNeoXConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
                    "qwen2_moe": transformers.Qwen2MoeConfig, "gpt_oss": transformers.GptOssConfig,
                    "deepseek_v3": transformers.DeepseekV3Config}[architecture]
    sizes = {**TINY_LLAMA, **overrides}
    # Qwen3's and Gemma's head_dim is its own setting (default 128, 256), not hidden_size / heads.
    if architecture in ("qwen3", "gemma2", "gemma3", "qwen3_moe", "gpt_oss"):
        sizes.setdefault("head_dim", sizes["hidden_size"] // sizes["num_attention_heads"])
    if architecture == "granite":
        sizes = {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 0.5,
                 "attention_multiplier": 0.25, **sizes}
    config = config_class(**sizes)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    # transformers 5 loads these checkpoints' tokenizers only from a tokenizer.json (a fast one).
    fast_only = ("granite", "mixtral", "qwen2_moe", "gpt_oss", "deepseek_v3")
    tokenizer = byte_level_tokenizer() if architecture in fast_only else transformers.ByT5Tokenizer(extra_ids=0)
    tokenizer.save_pretrained(path)
    return path


def write_tiny_dataset(path, num_files=2, documents_per_file=300, seed=0):
    """A folder of .txt files (one document a line) with structure a tiny model learns in a few steps."""
    rng = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    words = ["red", "green", "blue", "cat", "dog", "bird", "runs", "sits", "sings", "fast", "slow", "here"]
    for file_index in range(num_files):
        lines = []
        for _ in range(documents_per_file):
            start = rng.randrange(len(words))
            lines.append(" ".join(words[(start + i) % len(words)] for i in range(rng.randint(4, 12))) + ".")
        (path / f"part-{file_index}.txt").write_text("\n".join(lines) + "\n")
    return path


def tiny_model_built_once(**settings):
    """write_tiny_model's model with these settings, built once for every worker (built_once): one path in
    every test that trains it, so that their launches of a chapter with the same flags are one launch."""
    name = f"model-{hashlib.sha1(repr(sorted(settings.items())).encode()).hexdigest()[:12]}"
    return built_once(name, lambda folder: write_tiny_model(folder, **settings))


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_model_built_once()


# The tiny MoEs' depth and key/value heads (their experts vary by test).
MOE_SIZES = dict(num_hidden_layers=2, num_key_value_heads=2)
# Chapter 11 refuses a dense model: in the tests that run every chapter, it and its chapter 01 reference train
# a tiny Mixtral.
MOE_ONLY_CHAPTERS = {"11"}


@pytest.fixture(scope="session")
def tiny_moe():
    """A tiny Mixtral (2 layers, 4 experts, each token taking 2, 2 key/value heads)."""
    return tiny_model_built_once(architecture="mixtral", num_local_experts=4, num_experts_per_tok=2,
                                 **MOE_SIZES)


@pytest.fixture(scope="session")
def model_for(tiny_model, tiny_moe):
    """chapter -> the tiny model it trains in the tests that run every chapter."""
    return lambda chapter: tiny_moe if chapter in MOE_ONLY_CHAPTERS else tiny_model


def with_model(args, model):
    """The flags with -m's value replaced by model."""
    args = list(args)
    args[args.index("-m") + 1] = model
    return args


@pytest.fixture(scope="session")
def four_layer_models():
    """Tiny models deep enough for 4 pipeline stages: a Llama, a Qwen3 whose embedding is its output head, and a
    Granite, which scales its embeddings and logits outside the layers."""
    return {
        "llama": tiny_model_built_once(num_hidden_layers=4),
        "qwen3-tied": tiny_model_built_once(architecture="qwen3", num_hidden_layers=4,
                                            tie_word_embeddings=True),
        "granite": tiny_model_built_once(architecture="granite", num_hidden_layers=4),
    }


@pytest.fixture(scope="session")
def prompted_dataset():
    """A .jsonl of prompt/text pairs whose prompts (never labels) have very different lengths: packed rows then
    hold very different numbers of label tokens."""
    words = ["red", "green", "blue", "cat", "dog", "bird", "runs", "sits", "sings", "fast", "slow", "here"]
    lines = []
    for index in range(600):
        prompt = " ".join(words[(index + i) % 12] for i in range(1 + 4 * (index % 3)))
        text = " ".join(words[(index * 7 + i) % 12] for i in range(3 + index % 5)) + "."
        lines.append(json.dumps({"prompt": prompt + " ->", "text": text}))
    text = "\n".join(lines) + "\n"
    return built_once("prompted", lambda folder: (folder / "prompted.jsonl").write_text(text)) / "prompted.jsonl"


@pytest.fixture(scope="session")
def tiny_dataset():
    return built_once("tiny-dataset", write_tiny_dataset)


@pytest.fixture(scope="session")
def common_args(tiny_model, tiny_dataset):
    """Flags for a short, exact fp32 run from fixed pretrained weights on the on-disk dataset."""
    return ["-m", tiny_model, "--from-pretrained", "-d", tiny_dataset, "-s", 32, "--dtype", "float32",
            "--log-freq", 1, "--warmup-steps", 2]


@pytest.fixture(scope="session")
def launch_once():
    """run_chapter, but each distinct launch (chapter, flags, processes, environment) runs once per test
    session (built_once): the tests that need the same reference run share it, across modules and workers."""

    def launch(chapter, args, nproc=None, env=None, **kwargs):
        key = repr((chapter, list(map(str, args)), nproc, sorted((env or {}).items()), sorted(kwargs.items())))

        def build(folder):
            run = run_chapter(chapter, args, folder, nproc=nproc, env=env, **kwargs)
            (folder / "run.json").write_text(json.dumps(dataclasses.asdict(run), default=str))

        folder = built_once(f"ch{chapter}-{nproc or 1}-{hashlib.sha1(key.encode()).hexdigest()[:12]}", build)
        run = json.loads((folder / "run.json").read_text())
        return Run(**{**run, "exp_dir": Path(run["exp_dir"])})

    return launch


def model_launcher(launch_once, common_args, models, steps, default_model):
    """launch(chapter, model, nproc, flags, **kwargs): a `steps`-step run of a chapter on models[model] with the
    common flags, shared across tests (launch_once)."""

    def launch(chapter, model=default_model, nproc=None, flags=("-b", 8), **kwargs):
        args = with_model([*common_args, "--max-steps", steps, *flags], models[model])
        return launch_once(chapter, args, nproc=nproc, **kwargs)

    return launch


def load_weights(hf_dir):
    """The exported model's tensors by name (fp32, CPU)."""
    from safetensors.torch import load_file

    weights = {}
    for file in sorted(Path(hf_dir).glob("*.safetensors")):
        weights.update(load_file(file))
    return weights


def checkpoint_weights(checkpoint_dir):
    """The model tensors of a DCP checkpoint by name, each whole (the shards of every rank joined)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(checkpoint_dir, Path(tmp) / "whole.pt")
        return torch.load(Path(tmp) / "whole.pt", weights_only=False)["model"]


def assert_tied_copies_equal(run):
    """A pipeline keeps two copies of a tied embedding/head matrix (first and last stage), which must stay one
    matrix: bit for bit equal in the run's last checkpoint, which stores each under its own name. (The export
    writes one copy under both names, so it cannot tell.)"""
    newest = sorted((run.exp_dir / "checkpoints").glob("step-*"))[-1]
    weights = checkpoint_weights(newest)
    assert weights["model.embed_tokens.weight"].equal(weights["lm_head.weight"])


def max_weight_diff(hf_dir_a, hf_dir_b):
    a, b = load_weights(hf_dir_a), load_weights(hf_dir_b)
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


def mean_weight_diff(hf_dir_a, hf_dir_b):
    """The mean distance over every weight: rounding (bf16) averages out in it, a systematic change does not."""
    a, b = load_weights(hf_dir_a), load_weights(hf_dir_b)
    assert a.keys() == b.keys()
    return (sum((a[name] - b[name]).abs().sum().item() for name in a) / sum(a[name].numel() for name in a))


# The fp32 tolerances of every parity check (N ranks against one process, a resume on another layout, a compiled
# run against an eager one): rounding in another order stays within them. Measured on 2026-12-03 over all 49
# parity checks of the suite (PARITY_RECORD below): at most 9.5e-7 on a loss (2 ulps of a loss near 5),
# 1.3e-6 relative on a gradient norm, and 1.2e-5 on a weight (Adam's step on a weight whose gradient is near
# zero magnifies rounding: the fresh-init runs of 06 and 07), 3.2e-6 elsewhere. Each bound is 3-5x that; one
# optimizer step more or less at the final learning rate moves weights by about 1.1e-4 (measured: chapter 02
# skipping its last step), 2.7x the weight bound.
LOSS_TOLERANCE = 5e-6
GRAD_NORM_TOLERANCE = 1e-5  # relative
WEIGHT_TOLERANCE = 4e-5


def assert_same_training(ours, reference, steps=None, first_step=1):
    """Two runs log the same steps (1..steps, default: the reference's), the same losses and gradient norms from
    first_step on, the same learning rates, and export the same weights, to the tolerances above."""
    steps = steps or len(reference.metrics)
    assert [m["step"] for m in ours.metrics] == [m["step"] for m in reference.metrics] == list(range(1, steps + 1))
    compared = list(zip(ours.metrics, reference.metrics))[first_step - 1 :]
    # The validation loss is on the lines of the evaluation steps, the same steps in both runs.
    assert [("val_loss" in mine) for mine, _ in compared] == [("val_loss" in theirs) for _, theirs in compared]
    differences = {
        "loss": max(abs(mine["loss"] - theirs["loss"]) for mine, theirs in compared),
        "grad_norm": max(abs(mine["grad_norm"] / theirs["grad_norm"] - 1) for mine, theirs in compared),
        "weights": max_weight_diff(ours.exp_dir / "hf", reference.exp_dir / "hf"),
        "val_loss": max([abs(mine["val_loss"] - theirs["val_loss"]) for mine, theirs in compared
                         if "val_loss" in mine], default=0.0),
    }
    if os.environ.get("PARITY_RECORD"):  # PARITY_RECORD=<file> python -m pytest: how MEASURED was measured
        with open(os.environ["PARITY_RECORD"], "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST"), **differences}) + "\n")
    assert all(mine["lr"] == theirs["lr"] for mine, theirs in compared)
    assert differences["loss"] < LOSS_TOLERANCE, (differences, ours.losses, reference.losses)
    assert differences["val_loss"] < LOSS_TOLERANCE, differences
    # NOTE: with clipping active, a norm that missed a piece of the model (a dp or tp slice, a pipeline stage)
    # or counted one twice changes the updates, which the loss alone may hide for a few steps.
    assert differences["grad_norm"] < GRAD_NORM_TOLERANCE, differences
    assert differences["weights"] < WEIGHT_TOLERANCE, differences


def stop_then_resume(chapter, args, nproc, tmp_path, stop_after, elsewhere):
    """SIGTERM a launch after step `stop_after` (tests/inject.py) and check it saved that step and said how to
    resume; relaunch it as it was, and from a copy of the stopped run with the flags and process count of
    `elsewhere` = (args, nproc), another layout. Returns the two resumed runs."""
    stopped = run_chapter(chapter, args, tmp_path, nproc=nproc, script=INJECT, expect_ok=False,
                          env=inject_env(chapter, "sigterm", after_step=stop_after))
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    assert f"stopped by a signal after step {stop_after}; relaunch the same command to resume" in stopped.stderr
    assert [p.name for p in (stopped.exp_dir / "checkpoints").iterdir()] == [f"step-{stop_after:08d}"]
    shutil.copytree(stopped.exp_dir, tmp_path / "outputs" / "elsewhere")
    resumed = run_chapter(chapter, args, tmp_path, nproc=nproc)
    other_args, other_nproc = elsewhere
    resumed_elsewhere = run_chapter(chapter, other_args, tmp_path, nproc=other_nproc, experiment="elsewhere")
    for run in (resumed, resumed_elsewhere):
        assert f"at step {stop_after}" in run.stdout, run.stdout[-2000:]
    return resumed, resumed_elsewhere


def wandb_history(run_dir):
    """The rows an offline wandb run logged, read from its .wandb file."""
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for record in wandb_records(next(run_dir.glob("*.wandb")))
            if record.WhichOneof("record_type") == "history"]


def wandb_records(wandb_file):
    """The protobuf records of an offline .wandb file: a LevelDB-style log of 32 KiB blocks (after a 7-byte
    file header), each record a 7-byte header (CRC, length, type) and a protobuf Record."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = Path(wandb_file).read_bytes()
    position, pending = 7, b""
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:  # a block's tail too short for a header is padding
            position += 32768 - position % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def practice_cluster_state_dir():
    """A fresh state folder for practice-cluster/up.sh; skips (fails in CI) where up.sh cannot run."""
    missing = [tool for tool in SLURM_TOOLS if shutil.which(tool) is None]
    if os.geteuid() != 0 or missing:
        missing_system_tool(f"needs root and {', '.join(missing) or 'nothing'} "
                            "(apt-get install slurmctld slurmd slurm-client munge)")
    # NOTE: munged (user munge) must reach its socket folder, so no 0700 pytest temp dir above the state.
    state = Path(tempfile.mkdtemp(prefix="practice-cluster-"))
    state.chmod(0o755)
    return state


@pytest.fixture(scope="module")
def cluster():
    """A running two-node practice cluster (03-job-launchers/practice-cluster); always torn down, also when a
    test or up.sh fails. Tests that need it skip, with the reason, where it cannot run (not root, no Slurm)."""
    state = practice_cluster_state_dir()
    try:
        up = subprocess.run([PRACTICE / "up.sh", state], capture_output=True, text=True, timeout=120)
        if up.returncode != 0:
            pytest.fail(f"practice-cluster/up.sh failed:\n{up.stdout}\n{up.stderr}")
        yield state
    finally:
        subprocess.run([PRACTICE / "down.sh", state], capture_output=True, timeout=120)
        shutil.rmtree(state, ignore_errors=True)
