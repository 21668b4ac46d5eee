"""Choose a layout: for a model, a sequence length and a cluster, which layouts of chapters 02-11 fit, how fast
each should be, and the command that runs it.

    python plan.py                                             # Llama 3.1 405B on 8 nodes x 8 H100, -s 8192
    python plan.py meta-llama/Llama-3.1-8B --nodes 1 --gpu h200 -s 4096
    python plan.py MODEL --tp 8 --pp 8 --schedule 1f1b         # pin a layout instead of searching
    python plan.py MODEL --tp 8 --pp 8 --dry-run               # and build it with the chapter's own code
    python plan.py MODEL --json                                # every layout, as JSON

For every layout (data parallel by DDP, FSDP or HSDP; tensor, pipeline, context and expert parallel;
activation checkpointing; CPU offload; each pipeline schedule) it counts, per rank: the fp32 weights, gradients
and AdamW state (exactly: the dry run checks them against the chapter's built model), the gathered weights, the
activations and the step's peak (estimates, see the README); the bytes of each collective by link (inside a node
or across nodes); the FLOPs; the pipeline bubble; and a step time and MFU from the GPU's peak FLOP/s and the
links' bandwidths, with the term that dominates; for chapter 05's layouts also what each rank reads with
--from-pretrained and the host copy that --async-checkpoint stages. A layout that cannot work is refused with
the reason the chapter's own checks give. Needs torch and transformers; --dry-run and the refusals import the
chapters' scripts.
"""
import argparse
import collections
import contextlib
import copy
import functools
import importlib.util
import io
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch
import transformers
from safetensors import safe_open

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CHAPTER_FOLDERS = {name[:2]: name for name in os.listdir(ROOT) if re.match(r"\d\d-", name)}
GB = 1e9

# One GPU's memory (GB), dense bf16 peak (FLOP/s) and bandwidth per GPU and direction (GB/s) inside a node
# (NVLink), across nodes (one InfiniBand NIC per GPU) and to host memory (PCIe x16). Sources: NVIDIA's A100,
# H100 and H200 SXM datasheets (NVLink 600 / 900 GB/s both directions together; peaks without sparsity);
# ConnectX-6 HDR 200 Gb/s and ConnectX-7 NDR 400 Gb/s NICs, one per GPU as in DGX A100 / DGX H100 nodes;
# PCIe 4.0 / 5.0 x16, 32 / 64 GB/s a direction, of which copies reach about 80%.
GPUS = {
    "a100": dict(memory_gb=80, peak_flops=312e12, intra_node_gb_per_s=300, inter_node_gb_per_s=25,
                 pcie_gb_per_s=25),
    "h100": dict(memory_gb=80, peak_flops=989e12, intra_node_gb_per_s=450, inter_node_gb_per_s=50,
                 pcie_gb_per_s=50),
    "h200": dict(memory_gb=141, peak_flops=989e12, intra_node_gb_per_s=450, inter_node_gb_per_s=50,
                 pcie_gb_per_s=50),
}
PIPELINES = ("08", "09")
SPLIT_BACKWARD = ("interleaved-zb", "zbv")  # the zero-bubble schedules whose halves of a backward run apart
# the dtypes of a safetensors header (safe_open's get_dtype() names), as torch's
STORED_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                 "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def main():
    args = get_parser().parse_args()
    if args.dry_run and not pinned(args):
        sys.exit("error: --dry-run builds one layout: pin it with its flags (--tp, --pp, --cp, --ep, ...)")
    config, shapes, layouts, plans = plan_layouts(args)
    if args.json:
        print(json.dumps(plans, indent=1))
    else:
        print_plans(plans, config, shapes, args)
    if args.dry_run:
        # (a layout that does not fit in memory still builds: the dry run checks what each rank would hold; with
        # --json its lines go to stderr, so that stdout stays JSON)
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            failures = dry_run(layouts[0], config, plans[0], args)
        sys.exit(1 if failures else 0)
    if pinned(args) and not plans[0]["fits"]:
        sys.exit(1)


def plan_layouts(args):
    """(the config, its weights' shapes, the layouts, their plans): the pinned layout, else every one, those
    that fit first, fastest first."""
    config = load_config(args.model)
    shapes = parameter_shapes(config)
    layouts = [pinned_layout(args)] if pinned(args) else candidate_layouts(config, shapes, args)
    plans = [plan_layout(layout, config, shapes, args) for layout in layouts]
    plans.sort(key=lambda plan: (not plan["fits"], plan["step_time_s"] or math.inf,
                                 plan["peak_bytes_per_rank"] or math.inf))
    return config, shapes, layouts, plans


def get_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=os.path.relpath(os.path.join(ROOT, CHAPTER_FOLDERS["05"],
                                                                                 "llama-3.1-405b")),
                        help="Hugging Face id, local folder or config.json (default: Llama 3.1 405B's config)")
    cluster = parser.add_argument_group("the cluster")
    cluster.add_argument("--gpu", choices=GPUS, default="h100", help="memory, peak and bandwidths of a preset")
    cluster.add_argument("--nodes", type=positive_int, default=8)
    cluster.add_argument("--gpus-per-node", type=positive_int, default=8, help="ranks per node (one per GPU)")
    cluster.add_argument("--gpu-memory-gb", type=float, help="memory of one GPU (default: the preset's)")
    cluster.add_argument("--host-memory-gb", type=float, default=2048.0, help="CPU memory of one node")
    cluster.add_argument("--headroom-gb", type=float, default=6.0,
                         help="GPU memory not available to tensors: CUDA context, NCCL buffers, fragmentation")
    cluster.add_argument("--peak-tflops", type=float, help="dense bf16 peak of one GPU (default: the preset's)")
    cluster.add_argument("--intra-node-gb-per-s", type=float, help="GB/s per GPU and direction inside a node")
    cluster.add_argument("--inter-node-gb-per-s", type=float, help="GB/s per GPU and direction across nodes")
    cluster.add_argument("--compute-efficiency", type=float, default=0.5,
                         help="the fraction of the peak that the matmuls reach (an assumption: see the README)")
    cluster.add_argument("--host-adam-gb-per-s", type=float, default=20.0,
                         help="host memory GB/s that one rank's AdamW step on the CPU gets (--cpu-offload; an "
                              "assumption: a node's 8 ranks share its memory bandwidth)")
    batch = parser.add_argument_group("the batch")
    batch.add_argument("-s", "--seq-length", type=positive_int, default=8192)
    batch.add_argument("-b", "--batch-size", type=positive_int, default=1,
                       help="sequences in one forward on one rank")
    batch.add_argument("--global-batch-size", type=positive_int,
                       help="sequences per optimizer step (default: -b on every rank, one micro-batch)")
    batch.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="compute dtype")
    layout = parser.add_argument_group("a layout to pin (else every layout is planned)")
    layout.add_argument("--chapter", choices=sorted(set(CHAPTER_FOLDERS) - {"01", "03", "12"}),
                        help="the chapter whose script runs the layout (default: the one that teaches it)")
    layout.add_argument("--tp", type=positive_int)
    layout.add_argument("--pp", type=positive_int)
    layout.add_argument("--cp", type=positive_int)
    layout.add_argument("--ep", type=positive_int)
    layout.add_argument("--replicate-degree", type=positive_int)
    layout.add_argument("--schedule", help="a schedule that chapter 08 (all of torch's) or 09 takes")
    layout.add_argument("--num-microbatches", type=positive_int,
                        help="pipeline micro-batches a step (default: all rows)")
    layout.add_argument("--activation-checkpointing", action="store_true")
    layout.add_argument("--cpu-offload", action="store_true")
    layout.add_argument("--explicit-prefetch", action="store_true",
                        help="chapter 05's: start the next block's gather early (in forward; not at the peak)")
    layout.add_argument("--async-checkpoint", action="store_true",
                        help="chapter 05's: count the host copy that each rank stages its checkpoint in")
    parser.add_argument("--json", action="store_true", help="print every layout as JSON")
    parser.add_argument("--top", type=positive_int, default=5, help="how many layouts to show (default 5)")
    parser.add_argument("--dry-run", action="store_true",
                        help="build the pinned layout with the chapter's functions on the meta device, under a "
                             "fake process group of the full world size, and compare what ranks hold")
    parser.add_argument("--dry-run-ranks", type=int, nargs="+",
                        help="the ranks to build (default: rank 0 and the rank predicted to hold the most)")
    return parser


def positive_int(text):
    """A count the planner takes (ranks, rows, tokens, sizes): a whole number of at least 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def load_config(model):
    try:
        if os.path.isfile(model):
            with open(model) as f:
                return transformers.AutoConfig.for_model(**json.load(f))
        return transformers.AutoConfig.from_pretrained(model)
    except Exception as error:
        sys.exit(f"error: cannot read the config of {model!r} ({str(error).strip().splitlines()[0]}); pass a "
                 "Hugging Face id, a folder with config.json, or a config.json")


# --- The model, as transformers builds it -------------------------------------------------------------------


META_MODELS = {}  # id(config): (the config, kept so that its id names no other; its model on the meta device)


def meta_model(config):
    """The model on the meta device: every parameter's name and shape, no memory (405B: half a second)."""
    if id(config) not in META_MODELS:
        # (from_config sets its config's dtype to the one asked: a copy keeps the dtype the weights are stored in)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
        META_MODELS[id(config)] = (config, model)
    return META_MODELS[id(config)][1]


def parameter_shapes(config):
    """[(name, shape)] as named_parameters lists them: a tied head is the embedding and appears once."""
    return [(name, tuple(param.shape)) for name, param in meta_model(config).named_parameters()]


@functools.cache  # (a name's answer, asked millions of times in a search at 405B)
def layer_of(name):
    match = re.search(r"\.layers\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def is_expert(name):
    return ".experts." in name


def moe_layers(config, shapes):
    """The layers that hold routed experts (a MoE model's first layers may be dense): every layer of a MoE
    whose experts are not named as transformers' `experts`."""
    named = {layer_of(name) for name, _ in shapes if is_expert(name)} - {None}
    return named or set(range(text_config(config).num_hidden_layers) if num_experts(config) else ())


def is_tied(config):
    model = meta_model(config)
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def num_experts(config):
    config = text_config(config)
    return next((getattr(config, name) for name in ("num_local_experts", "num_experts", "n_routed_experts")
                 if getattr(config, name, None)), 0)


def experts_per_token(config):
    config = text_config(config)
    return next((getattr(config, name) for name in ("num_experts_per_tok", "top_k_experts", "moe_topk")
                 if getattr(config, name, None)), 0)


def head_dim(config):
    config = text_config(config)
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def attention_widths(config):
    """(the queries' width, the keys' or values' width) of a token: all heads', the key-value heads'."""
    config = text_config(config)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_attention_heads * head_dim(config), kv_heads * head_dim(config)


def norms_per_layer(shapes):
    """The norms of the hidden states in a layer: two in Llama, four in Gemma (not the attention's own)."""
    return sum(layer_of(name) == 0 and name.endswith("layernorm.weight") and ".self_attn." not in name
               for name, _ in shapes)


def has_per_head_norms(shapes):
    """Whether the layers norm each head's queries and keys (Qwen3, Gemma 3)."""
    return any(".q_norm." in name for name, _ in shapes)


# --- Layouts ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    chapter: str
    world: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    replicate_degree: int = 1
    schedule: str = None
    stages_per_rank: int = 1
    num_microbatches: int = 1
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    explicit_prefetch: bool = False
    async_checkpoint: bool = False

    @property
    def dp(self):
        """The data-parallel size: the number of groups that each train on their own rows."""
        return self.world // (self.tp * self.pp * self.cp)


def pinned(args):
    return any(value not in (None, False) for value in (
        args.chapter, args.tp, args.pp, args.cp, args.ep, args.replicate_degree, args.schedule,
        args.num_microbatches, args.activation_checkpointing, args.cpu_offload, args.explicit_prefetch,
        args.async_checkpoint))


def pinned_layout(args):
    """The layout the flags pin, as asked: refusal() says what of it no chapter runs."""
    world = args.nodes * args.gpus_per_node
    chapter = args.chapter or default_chapter(world, args)
    schedule = args.schedule or ("1f1b" if chapter in PIPELINES else None)
    layout = Layout(chapter, world, tp=args.tp or (world if chapter == "06" else 1),
                    pp=args.pp or (world if chapter == "08" else 1), cp=args.cp or 1, ep=args.ep or 1,
                    replicate_degree=args.replicate_degree or 1, schedule=schedule,
                    stages_per_rank=2 if schedule in several_stages_per_rank() else 1,
                    activation_checkpointing=args.activation_checkpointing, cpu_offload=args.cpu_offload,
                    explicit_prefetch=args.explicit_prefetch, async_checkpoint=args.async_checkpoint)
    return replace(layout, num_microbatches=args.num_microbatches or default_microbatches(layout, args))


def default_chapter(world, args):
    """The chapter that teaches the pinned flags."""
    if args.pp:
        return "08" if args.pp == world and not args.tp else "09"
    if args.cp:
        return "10"
    if args.ep:
        return "11"
    if args.tp:
        return "06" if args.tp == world else "07"
    return "05" if args.activation_checkpointing or args.explicit_prefetch or args.async_checkpoint else "04"


def default_microbatches(layout, args):
    """A pipeline takes all of its data-parallel group's rows of a step as micro-batches of -b rows."""
    if layout.chapter not in PIPELINES or layout.world % (layout.tp * layout.pp * layout.cp):
        return 1
    return max(1, global_batch(layout, args) // (layout.dp * args.batch_size))


def schedule_microbatches(layout, args):
    """The micro-batches one schedule call runs: --num-microbatches times the accumulation steps (chapters 08
    and 09 give the schedule all of them at once)."""
    return max(layout.num_microbatches, global_batch(layout, args) // (layout.dp * args.batch_size))


def global_batch(layout, args):
    """Sequences a step: --global-batch-size, else -b for every GPU (the same tokens a step in every layout)."""
    return args.global_batch_size or layout.world * args.batch_size


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(config, shapes, args):
    """Every layout the chapters' scripts run on this many GPUs: tensor parallelism inside a node, HSDP with one
    copy per node, each schedule; the planner refuses those that cannot work, with the reason."""
    world, per_node = args.nodes * args.gpus_per_node, args.gpus_per_node
    layouts = [Layout("02", world)]
    for replicate in sorted({1, args.nodes}):
        for offload in (False, True):
            layouts.append(Layout("04", world, replicate_degree=replicate, cpu_offload=offload))
            layouts.append(Layout("05", world, replicate_degree=replicate, cpu_offload=offload,
                                  activation_checkpointing=True))
    for tp in divisors(per_node)[1:]:
        layouts.append(Layout("06", world, tp=tp) if tp == world else Layout("07", world, tp=tp))
    for pp in divisors(world)[1:]:
        chapter = "08" if pp == world else "09"
        tps = [1] + [tp for tp in divisors(per_node)[1:] if world % (tp * pp) == 0] if chapter == "09" else [1]
        for tp in tps:
            for schedule in schedules(chapter):
                layouts.append(Layout(chapter, world, tp=tp, pp=pp, schedule=schedule,
                                      stages_per_rank=2 if schedule in several_stages_per_rank() else 1))
    for cp in divisors(world)[1:]:
        layouts.append(Layout("10", world, cp=cp))
    if num_experts(config):
        for ep in divisors(world)[1:]:
            layouts.append(Layout("11", world, ep=ep))
    return [replace(layout, num_microbatches=default_microbatches(layout, args)) for layout in layouts]


# --- What the chapter's script is told, and what it refuses --------------------------------------------------


@functools.cache
def chapter_module(chapter):
    """A chapter's train_llm.py as a module (its functions; main() does not run)."""
    path = os.path.join(ROOT, CHAPTER_FOLDERS[chapter], "train_llm.py")
    spec = importlib.util.spec_from_file_location(f"chapter_{chapter}_train_llm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def chapter_batch_size(layout, args):
    """The script's -b: one forward's rows, or with a pipeline the rows its micro-batches split."""
    return args.batch_size * (layout.num_microbatches if layout.chapter in PIPELINES else 1)


def chapter_flags(layout, args, model):
    flags = ["-m", model, "-s", args.seq_length, "-b", chapter_batch_size(layout, args),
             "--global-batch-size", global_batch(layout, args)]
    if layout.chapter in ("04", "05", "10", "11"):
        flags += ["--replicate-degree", layout.replicate_degree] if layout.replicate_degree > 1 else []
        flags += ["--cpu-offload"] if layout.cpu_offload else []
    flags += ["--activation-checkpointing"] if layout.activation_checkpointing else []
    flags += ["--explicit-prefetch"] if layout.explicit_prefetch else []
    flags += ["--async-checkpoint"] if layout.async_checkpoint else []
    flags += {"07": ["--tp", layout.tp], "09": ["--pp", layout.pp, "--tp", layout.tp],
              "10": ["--cp", layout.cp], "11": ["--ep", layout.ep]}.get(layout.chapter, [])
    if layout.chapter in PIPELINES:
        flags += ["--schedule", layout.schedule, "--num-microbatches", layout.num_microbatches]
    return [str(flag) for flag in flags]


def model_for_flags(model):
    """-m takes a folder: a config.json's folder stands for it."""
    return os.path.dirname(model) or "." if os.path.isfile(model) else model


def parses(chapter, flags):
    """Whether the chapter's argparse takes these flags."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            chapter_module(chapter).get_parser().parse_args(flags)
    except SystemExit:
        return False
    return True


@functools.cache
def schedules(chapter):
    """The schedules a pipeline chapter's script takes: chapter 08's, those its --schedule accepts."""
    return [name for name in chapter_module("08").SCHEDULES if parses(chapter, ["--schedule", name])]


@functools.cache
def several_stages_per_rank():
    return chapter_module("08").SEVERAL_STAGES_PER_RANK


# A value of each layout flag, to ask a chapter's parser whether it takes the flag.
LAYOUT_FLAGS = {"--tp": ["--tp", "2"], "--pp": ["--pp", "2"], "--cp": ["--cp", "2"], "--ep": ["--ep", "2"],
                "--replicate-degree": ["--replicate-degree", "2"], "--cpu-offload": ["--cpu-offload"],
                "--activation-checkpointing": ["--activation-checkpointing"],
                "--schedule": ["--schedule", "1f1b"], "--num-microbatches": ["--num-microbatches", "2"],
                "--explicit-prefetch": ["--explicit-prefetch"], "--async-checkpoint": ["--async-checkpoint"]}


@functools.cache
def flags_taken(chapter):
    return {flag for flag, example in LAYOUT_FLAGS.items() if parses(chapter, example)}


def refusal(layout, config, args):
    """Why the layout cannot run, in the words of the chapter's own checks (None if it can)."""
    world, chapter = layout.world, layout.chapter
    # (chapters 06 and 08 split over all ranks without a flag)
    asked = {"--tp": layout.tp > 1 and chapter != "06", "--pp": layout.pp > 1 and chapter != "08",
             "--cp": layout.cp > 1, "--ep": layout.ep > 1, "--replicate-degree": layout.replicate_degree > 1,
             "--cpu-offload": layout.cpu_offload, "--activation-checkpointing": layout.activation_checkpointing,
             "--schedule": layout.schedule is not None, "--num-microbatches": layout.num_microbatches > 1,
             "--explicit-prefetch": layout.explicit_prefetch, "--async-checkpoint": layout.async_checkpoint}
    untaken = [flag for flag, on in asked.items() if on and flag not in flags_taken(chapter)]
    own = None
    if untaken:
        wanted = {flag for flag, on in asked.items() if on}
        takers = [other for other in sorted(CHAPTER_FOLDERS) if os.path.exists(
            os.path.join(ROOT, CHAPTER_FOLDERS[other], "train_llm.py")) and wanted <= flags_taken(other)]
        other = f"chapter {takers[0]}'s does" if takers else f"no chapter's combines {', '.join(sorted(wanted))}"
        own = f"chapter {chapter}'s script does not take {', '.join(untaken)}; {other}"
    elif chapter in ("06", "08") and (layout.tp if chapter == "06" else layout.pp) != world:
        other, name = ("07", "--tp") if chapter == "06" else ("09", "--pp")
        own = (f"chapter {chapter} splits over all {world} ranks ({name} with data parallelism is chapter "
               f"{other}'s)")
    elif world % (layout.tp * layout.pp * layout.cp):
        own = (f"--tp {layout.tp} x --pp {layout.pp} x --cp {layout.cp} = {layout.tp * layout.pp * layout.cp} "
               f"does not divide the {world} ranks")
    elif world % layout.replicate_degree:
        own = (f"--replicate-degree {layout.replicate_degree} does not divide the {world} ranks; pass a divisor "
               "of the number of ranks, such as the number of nodes")
    elif layout.ep > 1 and not num_experts(config):
        own = f"{config.model_type} has no experts to split over --ep {layout.ep}"
    elif layout.ep > 1 and num_experts(config) % layout.ep:
        own = (f"--ep {layout.ep} does not divide the {num_experts(config)} experts of each layer; pass a "
               "divisor of the number of experts")
    if own:
        return own
    module = chapter_module(chapter)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            chapter_args = module.get_parser().parse_args(chapter_flags(layout, args, model_for_flags(args.model)))
        if chapter in ("06", "07"):
            module.check_tensor_parallel_fits(config, args.seq_length, layout.tp)
        elif chapter == "08":
            module.check_pipeline_fits(chapter_args, config, layout.pp, layout.stages_per_rank)
        elif chapter == "09":
            module.check_mesh_fits(chapter_args, world)
            module.check_tensor_parallel_fits(config, args.seq_length, layout.tp)
            module.check_pipeline_fits(chapter_args, config, layout.pp, layout.stages_per_rank)
        elif chapter == "10":
            module.check_context_parallel_fits(chapter_args, config, world)
        elif chapter == "11":
            module.check_expert_parallel_fits(chapter_args, config, world)
            module.expert_modules(meta_model(config))  # (experts in a form this chapter splits)
        module.fit_grad_accum_steps(chapter_args, layout.dp if chapter not in ("06", "08") else 1)
    except SystemExit as stop:
        return str(stop.code).removeprefix("error: ")
    return None


# --- What each rank holds: the fp32 weights, gradients and AdamW state ----------------------------------------


def tp_dim(name, layout):
    """The dim that tensor parallelism splits (chapter 06's plan), or None for a weight it replicates."""
    return None if layout.tp == 1 else tensor_parallel_dim(name)


@functools.cache  # (a name's answer, asked millions of times in a search at 405B)
def tensor_parallel_dim(name):
    if re.search(r"\.layers\.\d+\.(self_attn\.[qkv]_proj|mlp\.(gate|up)_proj)\.(weight|bias)$", name):
        return 0
    if re.search(r"\.layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.weight$", name):
        return 1
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return 0
    return None


def stages_of_rank(layout, rank):
    """The pipeline stages a rank runs (chapters 08 and 09's placement), or [0] without a pipeline."""
    if layout.pp == 1:
        return [0]
    num_stages = layout.pp * layout.stages_per_rank
    pp_rank = rank // (layout.world // layout.pp)
    if layout.schedule in ("zbv", "dualpipev"):
        return [i for i in range(num_stages) if min(i, num_stages - 1 - i) == pp_rank]
    return list(range(pp_rank, num_stages, layout.pp))


def stage_holds(name, stage, num_stages, num_layers):
    layer = layer_of(name)
    if layer is not None:
        return stage * num_layers // num_stages <= layer < (stage + 1) * num_layers // num_stages
    if "embed_tokens" in name:
        return stage == 0
    return stage == num_stages - 1  # the final norm and the head


def chunk(length, parts, index):
    """The rows of dim `length` that shard `index` of `parts` holds: fully_shard's torch.chunk split."""
    size = math.ceil(length / parts)
    return max(0, min(size, length - index * size))


def local_numel(name, shape, layout, rank):
    """Elements of one weight that a rank holds."""
    shape = list(shape)
    split = tp_dim(name, layout)
    if split is not None:
        shape[split] //= layout.tp
    chapter = layout.chapter
    if chapter in ("04", "05", "10", "11"):
        if chapter == "11" and is_expert(name):
            shape[0] //= layout.ep
            edp = layout.world // layout.ep
            shape[1] = chunk(shape[1], edp, rank // layout.ep)
        else:
            shards = layout.world // layout.replicate_degree
            shape[0] = chunk(shape[0], shards, rank % shards)
    elif chapter in ("07", "09"):
        dp_rank = (rank // layout.tp) % layout.dp
        shape[0] = chunk(shape[0], layout.dp, dp_rank)
    return math.prod(shape)


def unsharded_numel(name, shape, layout):
    """Elements of one weight that a rank's FSDP group gathers: its tensor-parallel slice, and with expert
    parallelism only its ep rank's experts."""
    elements = math.prod(shape) // (layout.tp if tp_dim(name, layout) is not None else 1)
    return elements // layout.ep if layout.chapter == "11" and is_expert(name) else elements


def rank_weights(layout, config, shapes, rank):
    """(elements, number of weight tensors) that a rank's optimizer holds, its pipeline stages' only."""
    stages, num_layers = stages_of_rank(layout, rank), text_config(config).num_hidden_layers
    elements, tensors = 0, 0
    for name, shape in shapes:
        copies = copies_held(layout, config, name, stages, num_layers)
        elements += copies * local_numel(name, shape, layout, rank)
        tensors += copies
    return elements, tensors


def copies_held(layout, config, name, stages, num_layers):
    """How many copies of a weight a rank's pipeline stages hold: one a stage that holds it, and the last
    stage's head, a copy of a tied embedding. (The callers read num_layers once: a transformers config's
    attributes are slow to read, and 405B's plans ask millions of times.)"""
    num_stages = layout.pp * layout.stages_per_rank
    held = sum(stage_holds(name, stage, num_stages, num_layers) for stage in stages)
    tied_head = layout.pp > 1 and "embed_tokens" in name and is_tied(config) and num_stages - 1 in stages
    return held + tied_head


def state_bytes(elements, tensors):
    """fp32 weights and gradients, AdamW's two fp32 moments and its step counter (a 4-byte tensor a weight)."""
    return {"weights": 4 * elements, "gradients": 4 * elements, "optimizer": 8 * elements + 4 * tensors}


# --- The step: activations, gathered weights, collectives, FLOPs, time ----------------------------------------


def activation_bytes_per_token(config, shapes, layout, compute_bytes):
    """(bytes per token that a layer saves for backward on a rank, on average over the layers, that the head and
    the loss save, and the logits' gradient at the start of backward). Counted from what Hugging Face's Llama
    saves with sdpa attention (RMSNorm in fp32), with Gemma's norms of the attention's and the MLP's outputs and
    Qwen3's and Gemma 3's norms of each head's queries and keys where the model has them, and each layer's MLPs
    as mlp_bytes_per_token counts them; tensor parallelism splits what its plan splits (sequence-parallel norms
    included) but for the gathered inputs of the column-parallel matmuls."""
    config = text_config(config)
    b, tp, h = compute_bytes, layout.tp, config.hidden_size
    q_dim, kv_dim = attention_widths(config)
    # a layer's two norms keep their input, their fp32 output and the --dtype output the next matmul takes;
    # Gemma's norms of the attention's and the MLP's outputs feed the residual's sum: their fp32 input and output
    norms = 2 * (4 + b) * h / tp + 2 * b * h + max(0, norms_per_layer(shapes) - 2) * 8 * h / tp
    if has_per_head_norms(shapes):
        norms += (4 + b) * (q_dim + kv_dim) / tp
    # q, the attention's output, k and v, and sdpa's log-sum-exp; with context parallelism every rank keeps
    # the whole sequence's keys and values for its backward
    attention = (b * (2 * q_dim + 2 * kv_dim * layout.cp) + 4 * config.num_attention_heads) / tp
    per_layer = norms + attention + mlp_bytes_per_token(config, shapes, layout, b) + 8
    # the final norm, the logits the loss keeps (log-softmax in fp32) and the logits, the token ids and labels;
    # at the start of backward the gradient of the logits (fp32, then --dtype)
    head = (4 + 2 * b) * h + (4 + b) * config.vocab_size / tp + 16
    return per_layer, head, (4 + b) * config.vocab_size / tp


def mlp_bytes_per_token(config, shapes, layout, compute_bytes):
    """What a layer's MLPs save a token, on average over the layers: a dense MLP (a layer's own, or a MoE
    layer's shared experts, read from its weights' shapes) its gate, silu(gate), up and their product; the
    same for each routed expert a token goes to, plus the copy of the token each expert's first matmul keeps,
    the output its routing weight multiplies and the router's logits; a shared expert's gate, the output it
    scales. Tensor parallelism splits what chapter 06's plan splits: a layer's own MLP."""
    b, h, num_layers = compute_bytes, config.hidden_size, config.num_hidden_layers
    moe = moe_layers(config, shapes)
    bytes_of_layer = collections.Counter()
    for name, shape in shapes:
        layer = layer_of(name)
        if layer is None or is_expert(name):
            continue
        split = layout.tp if tp_dim(name, layout) is not None else 1
        if name.endswith("gate_up_proj.weight"):  # [2 x width, hidden]: a fused gate and up
            bytes_of_layer[layer] += 4 * b * shape[0] / 2 / split
        elif name.endswith("up_proj.weight"):  # [width, hidden]
            bytes_of_layer[layer] += 4 * b * shape[0] / split
        elif name.endswith("shared_expert_gate.weight"):
            bytes_of_layer[layer] += b * h
    for layer in range(num_layers):
        if layer in moe:
            bytes_of_layer[layer] += 4 * b * mlp_width(config) + 2 * b * h * experts_per_token(config)
            bytes_of_layer[layer] += 4 * num_experts(config)
        elif not bytes_of_layer[layer]:  # MLP weights not named as Llama's: as wide as the config says
            bytes_of_layer[layer] = 4 * b * (getattr(config, "intermediate_size", None) or 4 * h) / layout.tp
    return sum(bytes_of_layer.values()) / num_layers


def mlp_width(config):
    """The rows of a token's MLP intermediate: a MoE layer's, once for each expert the token goes to."""
    inter = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    if num_experts(config):
        inter = (getattr(config, "moe_intermediate_size", None) or inter) * experts_per_token(config)
    return inter


def passes_in_flight(layout, pp_rank, microbatches):
    """How many stage passes (a micro-batch through one stage) a pipeline rank holds the activations of at once,
    at its first backward: GPipe all; 1F1B p - r on rank r; interleaved, torch's warm-up of (v-1)p + 2(p-1-r) +
    1 stage passes; DualPipeV 2p + 1 at most (the zero-bubble ones: split_backward_passes)."""
    p, m, v = layout.pp, microbatches, layout.stages_per_rank
    in_flight = {"gpipe": m * v, "1f1b": min(m, p - pp_rank),
                 "interleaved-1f1b": min(m * v, (v - 1) * p + 2 * (p - 1 - pp_rank) + 1),
                 "dualpipev": min(m * v, 2 * p + 1)}
    return in_flight[layout.schedule]


def split_backward_passes(layout, microbatches, pp_rank, stage_pass, kept_for_weights):
    """(passes in flight, passes whose input halves of the backward have run but not their weight halves) at the
    peak of pipeline rank r under torch's order of the halves (checked against it once, for p <= 8, v <= 4,
    m <= 5p):
    - interleaved zero bubble: a warm-up of w = (v-1)q + p-1-r forwards (q micro-batches a round), then rank r
      holds back its weight halves r steps: w + r + 1 passes, r + 1 of them split;
    - ZBV: its warm-up's up to 2p passes, one split, or its cool-down's, where rank r runs 2r + 1 input halves
      ahead of their weight halves with p + r passes alive (2(m - p) + 1 at most of either). Exact for
      m >= 2p - 1; below it an upper bound, exact on the rank that holds the most."""
    p, m, v, r = layout.pp, microbatches, layout.stages_per_rank, pp_rank
    if layout.schedule == "interleaved-zb":
        warm_up = min(m * v, (v - 1) * (m // max(1, m // p)) + p - 1 - r)
        held_back = min(r, m * v - warm_up - 1) if m * v > warm_up else 0
        return (warm_up + held_back + 1 if m * v > warm_up else warm_up), held_back + 1
    cap = 2 * (m - p) + 1
    warm_up, cool_down = (min(m + r + 1, 2 * p), 1), (min(p + r, cap), min(2 * r + 1, cap))
    return max(warm_up, cool_down, key=lambda passes: passes[0] * stage_pass + passes[1] * kept_for_weights)


def kept_for_weight_gradients(config, shapes, layout, compute_bytes):
    """Bytes per token of one layer's pass that torch's split backward keeps from its input half to its weight
    half: the gradient of each weighted op's output (q, k, v, o, the MLP's gate, up and down, once per expert
    a token goes to, the two norms; Qwen3's per-head norms). Measured: 10.5 MB a pass of one layer of hidden
    512 (kv 256, MLP 1024) at 512 tokens in fp32, the 5,120 values a token this counts."""
    config = text_config(config)
    h, k = config.hidden_size, experts_per_token(config) if num_experts(config) else 1
    q_dim, kv_dim = attention_widths(config)
    per_head_norms = q_dim + kv_dim if has_per_head_norms(shapes) else 0
    outputs = q_dim + 2 * kv_dim + per_head_norms + 3 * h + 2 * mlp_width(config) + k * h
    return compute_bytes * outputs / layout.tp


def bubble(layout, microbatches):
    """The share of a step a pipeline rank idles: (p-1)/(m+p-1) for GPipe and 1F1B, ramps v times shorter
    interleaved (chapter 08); with the split backward, a third of that (our assumption; chapter 08 measures
    12% against 16-18% at p 2, m 4); ZBV's, in thirds of a pass (forward, input and weight halves alike), its 6m
    busy and max(p - 1, 2(2p - 1 - m)) idle, from torch's order of the halves and their dependencies (fewer
    than 2p - 1 micro-batches leave holes in it); DualPipeV none, its ideal."""
    p, m, v = layout.pp, microbatches, layout.stages_per_rank
    if p == 1:
        return 0.0
    zbv_idle = max(p - 1, 2 * (2 * p - 1 - m))
    return {"gpipe": (p - 1) / (m + p - 1), "1f1b": (p - 1) / (m + p - 1),
            "interleaved-1f1b": (p - 1) / (v * m + p - 1), "interleaved-zb": (p - 1) / (3 * (v * m + p - 1)),
            "zbv": zbv_idle / (6 * m + zbv_idle), "dualpipev": 0.0}[layout.schedule]


def memory_per_rank(layout, config, shapes, args, rank):
    """Bytes a rank holds in a step, by part (the weights, gradients and AdamW state exactly): those on the GPU
    at the peak, and the gradients after it and the host copies that plan_layout names as such."""
    text, cd = text_config(config), compute_bytes(args)
    elements, tensors = rank_weights(layout, config, shapes, rank)
    memory = state_bytes(elements, tensors)
    # What FSDP gathers (the tensor-parallel slice, the ep rank's experts): the largest layer (a MoE model's
    # dense layers are smaller), the largest group (chapter 11 makes a layer's experts a group of their own),
    # and the head
    elements_of = collections.Counter()  # (layer, experts or not): elements
    for name, shape in shapes:
        if layer_of(name) is not None:
            elements_of[layer_of(name), is_expert(name)] += unsharded_numel(name, shape, layout)
    layers = range(text.num_hidden_layers)
    layer = max(elements_of[index, False] + elements_of[index, True] for index in layers)
    group = layer
    if layout.chapter == "11":
        group = max(max(elements_of[index, False], elements_of[index, True]) for index in layers)
    head = max(unsharded_numel(name, shape, layout) for name, shape in shapes
               if name.endswith(("embed_tokens.weight", "lm_head.weight")))
    pp_rank = rank // (layout.world // layout.pp)
    stages = stages_of_rank(layout, rank)
    last_stage = layout.pp * layout.stages_per_rank - 1
    holds_head = last_stage in stages
    if layout.chapter == "09":
        # torch's pipelining keeps a stage's weights gathered and its fp32 gradients whole until the step's end
        # (FSDP's unsharded copies: at dp 1 too)
        stage = sum(stage_elements(layout, config, shapes, stages))
        memory.update(gathered_weights=cd * stage, gathered_gradients=4 * stage)
        if layout.stages_per_rank > 1:
            # interleaved, the peak falls in a forward of the rank's later stage, which gathers it again: FSDP's
            # all-gather output of a layer, alive beside the unsharded copies (measured)
            memory["all_gather_output"] = cd * layer
    elif layout.chapter in ("04", "05", "10", "11") or (layout.chapter == "07" and layout.dp > 1):
        # the layer computing and the next group arriving, or the head, which stays gathered from its forward to
        # its backward; in backward a group's (or the head's) whole gradients in --dtype, and reduced in fp32.
        # (Explicit prefetch's third layer is gathered only while the forward runs, below the peak: measured.)
        memory.update(gathered_weights=cd * max(layer + group, 2 * head),
                      gathered_gradients=(cd + (4 if cd != 4 else 0)) * max(group, head))
    elif cd != 4:
        memory["autocast_copies"] = cd * elements  # autocast's --dtype copy of each fp32 matmul weight
    per_layer, head_saves, logits_gradient = activation_bytes_per_token(config, shapes, layout, cd)
    tokens = args.batch_size * args.seq_length / layout.cp  # one micro-batch's tokens on a rank
    head_passes = 1  # the micro-batches whose head and loss activations are held at once
    if layout.pp > 1:
        # a pass through a stage before the last also keeps its output (fp32 hidden states) for its backward
        sending = sum(stage != last_stage for stage in stages) / len(stages)
        stage_pass = (per_layer * text.num_hidden_layers / (layout.pp * layout.stages_per_rank)
                      + sending * 4 * text.hidden_size / layout.tp)
        microbatches = schedule_microbatches(layout, args)
        if layout.schedule in SPLIT_BACKWARD:
            # the split backward keeps each pass's graph and its weighted ops' output gradients until its weight
            # half runs
            kept = (kept_for_weight_gradients(config, shapes, layout, cd) * text.num_hidden_layers
                    / (layout.pp * layout.stages_per_rank))
            in_flight, waiting = split_backward_passes(layout, microbatches, pp_rank, stage_pass, kept)
            memory["split_backward"] = tokens * kept * waiting
        else:
            in_flight = passes_in_flight(layout, pp_rank, microbatches)
        layer_bytes = stage_pass * in_flight
        head_passes = microbatches if layout.schedule == "gpipe" else 1  # GPipe runs every forward first
    elif layout.activation_checkpointing:
        # a checkpointed block keeps its input; backward recomputes one block at a time
        layer_bytes = cd * text.hidden_size * text.num_hidden_layers + per_layer
    else:
        layer_bytes = per_layer * text.num_hidden_layers
    head_bytes = head_passes * head_saves + logits_gradient if holds_head else 16
    memory["activations"] = tokens * (layer_bytes + head_bytes)
    if layout.pp > 1:
        # The gradients come with a stage's first backward: the peak is there (the passes in flight, no
        # gradients), or at a later backward with them, which holds one pass fewer where no forward is left to
        # bring the count back (GPipe; 1F1B with no more micro-batches than the stages from it to the last)
        later = min(in_flight, microbatches * layout.stages_per_rank - 1)
        made = memory.get("gathered_gradients", memory["gradients"])  # chapter 09's whole ones, or the stage's
        if tokens * stage_pass * (in_flight - later) < made:
            memory["activations"] -= tokens * stage_pass * (in_flight - later)
            if "gathered_gradients" not in memory:
                memory["gradients_at_the_peak"] = made
        else:
            memory.pop("gathered_gradients", None)  # chapter 09's: made after the peak, the first backward
        # torch's stages keep a receive buffer a micro-batch, for the input (all but the first stage) and the
        # output's gradient (all but the last) from another rank: fp32 hidden states, split by sequence
        # parallelism. (The stages at the bottom of a V pass them on their rank.)
        boundaries = sum((stage > 0) + (stage < last_stage) for stage in stages)
        received = boundaries - 2 * sum(stage + 1 in stages for stage in stages)
        hidden_states = tokens * 4 * text.hidden_size / layout.tp
        memory["pipeline_buffers"] = received * microbatches * hidden_states
        if layout.schedule in SPLIT_BACKWARD:
            # these schedules wait for their sends at the end of the step: the passes finished by the peak keep
            # the output and the input's gradient they passed on
            finished = microbatches * layout.stages_per_rank - in_flight
            memory["sends_awaited"] = finished * boundaries / len(stages) * hidden_states
            # an input half peaks at its end, in the first norm's backward (fp32 temporaries of 3 hidden states)
            memory["backward_working"] = tokens * 3 * 4 * text.hidden_size / layout.tp
        elif not holds_head:
            # where no logits' gradient comes first, a layer's backward sets the peak: the gradients of the MLP's
            # gate and up outputs are alive at once
            memory["backward_working"] = tokens * 2 * cd * mlp_width(text) / layout.tp
    if layout.pp == 1 and not layout.cpu_offload and not gradients_at_peak(layout, args):
        # Backward frees each layer's activations as that layer's gradients arrive. Where a layer keeps less than
        # its gradients take (a checkpointed one keeps its input), the peak comes at the last layer's backward,
        # with the others' gradients made: one layer's activations and input then, the logits long freed.
        last_layer = tokens * (per_layer + (cd * text.hidden_size if layout.activation_checkpointing else 0))
        made = memory["gradients"] * (text.num_hidden_layers - 1) / text.num_hidden_layers
        if last_layer + made > memory["activations"]:
            memory.update(activations=last_layer, gradients_at_the_peak=made)
    if layout.async_checkpoint:
        # the copy of the rank's weights and AdamW state in host memory that a background save writes from
        memory["checkpoint_staging"] = memory["weights"] + memory["optimizer"]
    return memory


def compute_bytes(args):
    return 2 if args.dtype == "bfloat16" else 4


def group_link(stride, size, per_node):
    """Whether a group of `size` ranks `stride` apart (in torchrun's numbering) stays inside a node."""
    return "intra_node" if stride * size <= per_node and per_node % (stride * size) == 0 else "inter_node"


def collectives_per_step(layout, config, shapes, args):
    """{collective: {link: bytes a rank sends in a step}}: ring algorithms send (n-1)/n of a gathered or
    scattered tensor and twice that for a sum (all-reduce)."""
    text, cd, world, per_node = text_config(config), compute_bytes(args), layout.world, args.gpus_per_node
    micro_steps = global_batch(layout, args) // (layout.dp * args.batch_size)  # forwards a rank runs a step
    comm = {}

    def add(collective, link, size):
        comm.setdefault(collective, {}).setdefault(link, 0.0)
        comm[collective][link] += size

    # a rank's weights before FSDP shards them: its stages' tensor-parallel slices and its ep rank's experts
    expert = sum(unsharded_numel(name, shape, layout) for name, shape in shapes if is_expert(name))
    dense = sum(unsharded_numel(name, shape, layout) for name, shape in shapes) - expert
    # The chapters' FSDP gathers each block for forward and again for backward every micro-batch, the head and
    # the root's weights (the final norm, a tied embedding; in 07 the embedding too) once: they stay gathered
    # from forward to backward. It reduce-scatters every micro-batch's gradients.
    own_group = ("embed_tokens.weight",) if layout.chapter != "07" and not is_tied(config) else ()
    once = sum(unsharded_numel(name, shape, layout) for name, shape in shapes
               if layer_of(name) is None and not name.endswith(own_group))
    stages_by_pp_rank = [stages_of_rank(layout, r * (world // layout.pp)) for r in range(layout.pp)]
    groups = []  # (elements, of them gathered in a step, the FSDP group's rank stride and size, HSDP's copies)
    if layout.chapter == "07":
        groups = [(dense, micro_steps * (2 * dense - once), layout.tp, layout.dp, 1)]
    elif layout.chapter == "09":
        # Under torch's pipelining a stage's blocks stay gathered from a backward to the next forward, which
        # frees them: gathered before the first forward and before each backward that follows a forward, the
        # micro-batches + 1 times a step; its root's weights once. Gradients are reduce-scattered once a step.
        layers_and_root = [stage_elements(layout, config, shapes, stages) for stages in stages_by_pp_rank]
        layers, root = max(layers_and_root, key=lambda held: (micro_steps + 1) * held[0] + held[1])
        groups = [(layers + root, (micro_steps + 1) * layers + root, layout.tp, layout.dp, 1)]
    elif layout.chapter == "11":
        groups = [(dense, micro_steps * (2 * dense - once), 1, world // layout.replicate_degree,
                   layout.replicate_degree),
                  (expert, micro_steps * 2 * expert, layout.ep, world // layout.ep, 1)]
    elif layout.chapter in ("04", "05", "10"):
        groups = [(dense + expert, micro_steps * (2 * (dense + expert) - once), 1,
                   world // layout.replicate_degree, layout.replicate_degree)]
    elif layout.chapter == "02" and world > 1:
        add("all_reduce (DDP gradients)", group_link(1, world, per_node),
            2 * (world - 1) / world * 4 * (dense + expert))
    reduces = 1 if layout.chapter == "09" else micro_steps
    for elements, gathered, stride, n, copies in groups:
        if n > 1:
            link, share = group_link(stride, n, per_node), (n - 1) / n
            add("all_gather (FSDP weights)", link, cd * gathered * share)
            add("reduce_scatter (FSDP gradients)", link, reduces * 4 * elements * share)
        if copies > 1:
            add("all_reduce (HSDP gradients)", group_link(n, copies, per_node),
                reduces * 2 * (copies - 1) / copies * 4 * elements / n)
    layers = text.num_hidden_layers / layout.pp
    tokens = args.batch_size * args.seq_length
    last_stage = layout.pp * layout.stages_per_rank - 1
    if layout.tp > 1:
        link, share = group_link(1, layout.tp, per_node), (layout.tp - 1) / layout.tp
        # a layer's 2 all-gathers and 2 reduce-scatters of [b, s, hidden] forward, the same backward; the
        # embedding's and the head's 2 each (on the first and the last stage); loss_parallel's 3 all-reduces
        # of one number a token
        ends = max(2 * (0 in stages) + 2 * (last_stage in stages) for stages in stages_by_pp_rank)
        add("all_gather + reduce_scatter (TP activations)", link,
            micro_steps * (8 * layers + ends) * tokens * text.hidden_size * cd * share)
        add("all_reduce (TP loss)", link, micro_steps * 3 * 2 * share * tokens * 4)
    if layout.pp > 1:
        # each stage sends its output forward and its input's gradient back, per micro-batch (08: fp32, 09: the
        # tensor-parallel slice in --dtype), to a neighbour on another rank: the busiest rank's count
        message = tokens / layout.tp * text.hidden_size * (4 if layout.chapter == "08" else cd)
        add("send/recv (pipeline)", group_link(world // layout.pp, layout.pp, per_node),
            micro_steps * max(pipeline_sends(stages, last_stage) for stages in stages_by_pp_rank) * message)
        if is_tied(config) and last_stage not in stages_by_pp_rank[0]:
            # the first and the last stage each hold the tied matrix: its fp32 gradient is summed once a step
            # (09: each rank's FSDP shard of its tensor-parallel slice); a V holds both on one rank
            shards = layout.tp * (layout.dp if layout.chapter == "09" else 1)
            ends_link = group_link((layout.pp - 1) * (world // layout.pp), 2, per_node)
            tied_bytes = 4 * text.vocab_size * text.hidden_size / shards
            add("all_reduce (tied embedding gradient)", ends_link, tied_bytes)
    if layout.cp > 1:
        kv_dim = attention_widths(config)[1]
        local = tokens / layout.cp * kv_dim * cd
        # keys and values gathered in forward (all_gather), their gradients sent back in backward (all_to_all)
        add("all_gather + all_to_all (CP keys, values)", group_link(1, layout.cp, per_node),
            micro_steps * text.num_hidden_layers * 4 * (layout.cp - 1) * local)
    if layout.ep > 1:
        routed = tokens * experts_per_token(config) * text.hidden_size * cd
        # each MoE layer sends its tokens' rows to their experts and back, forward and backward
        add("all_to_all (EP tokens)", group_link(1, layout.ep, per_node),
            micro_steps * len(moe_layers(config, shapes)) * 4 * routed * (layout.ep - 1) / layout.ep)
    return comm


def stage_elements(layout, config, shapes, stages):
    """(elements of the layers, of the rest) that a pipeline rank holding `stages` holds, before FSDP shards
    them: its tensor-parallel slices, and on the last stage the tied head's copy of the embedding."""
    layers, root, num_layers = 0, 0, text_config(config).num_hidden_layers
    for name, shape in shapes:
        held = copies_held(layout, config, name, stages, num_layers) * unsharded_numel(name, shape, layout)
        if layer_of(name) is None:
            root += held
        else:
            layers += held
    return layers, root


def pipeline_sends(stages, last_stage):
    """Messages a pipeline rank that holds `stages` sends a micro-batch: each stage's output but the last
    stage's, each input gradient but the first stage's, where the neighbouring stage sits on another rank (a
    V's turn stays on its rank)."""
    return sum((stage < last_stage and stage + 1 not in stages) + (stage > 0 and stage - 1 not in stages)
               for stage in stages)


def flops_per_token(config, shapes, seq_length):
    """The chapters' training_flops_per_token: 6 a matmul weight (every weight but the input embedding, which
    is one again as a tied head; of the experts those a token passes through) plus the attention scores."""
    experts, k, text = num_experts(config), experts_per_token(config), text_config(config)
    total = 0
    for name, shape in shapes:
        count = math.prod(shape)
        if "embed_tokens" in name:
            count = count if is_tied(config) else 0
        elif is_expert(name):
            count = count * k // experts
        total += count
    return 6 * total + 12 * text.num_hidden_layers * text.hidden_size * seq_length


def plan_layout(layout, config, shapes, args):
    """What a layout holds, sends and costs, whether it fits, and its command (or why it cannot run)."""
    gpu = GPUS[args.gpu]
    usable = ((args.gpu_memory_gb or gpu["memory_gb"]) - args.headroom_gb) * GB
    reason = refusal(layout, config, args)
    plan = {"layout": {**asdict(layout), "dp": layout.dp}, "refused": reason is not None, "fits": False,
            "reason": reason, "peak_bytes_per_rank": None, "step_time_s": None, "mfu": None,
            "command": commands(layout, args)}
    if reason:
        return plan
    # The busiest rank sets the peak. Pipeline stages differ (the embedding, the head, the micro-batches in
    # flight), and within a stage the first of its ranks holds the first, largest shards of uneven splits.
    on_host = ("weights", "gradients", "optimizer") if layout.cpu_offload else ()
    on_host += ("checkpoint_staging",) if layout.async_checkpoint else ()
    after_peak = () if gradients_at_peak(layout, args) or layout.cpu_offload else ("gradients",)
    by_rank = {rank: memory_per_rank(layout, config, shapes, args, rank)
               for rank in range(0, layout.world, layout.world // layout.pp)}
    on_gpu = {rank: sum(bytes_ for part, bytes_ in memory.items() if part not in on_host + after_peak)
              for rank, memory in by_rank.items()}
    busiest = max(on_gpu, key=on_gpu.get)
    memory, peak_bytes = by_rank[busiest], on_gpu[busiest]
    host_bytes = args.gpus_per_node * sum(memory[part] for part in on_host)
    largest_batch = largest_batch_size(layout, config, shapes, args, busiest, on_host + after_peak, usable)
    comm = collectives_per_step(layout, config, shapes, args)
    step_tokens = global_batch(layout, args) * args.seq_length
    model_flops = flops_per_token(config, shapes, args.seq_length) * step_tokens
    terms = step_time_terms(layout, config, shapes, args, comm, model_flops, busiest)
    step_time = sum(terms.values())
    peak = args.peak_tflops * 1e12 if args.peak_tflops else gpu["peak_flops"]
    plan.update(
        fits=peak_bytes <= usable and host_bytes <= args.host_memory_gb * GB, busiest_rank=busiest,
        peak_bytes_per_rank=peak_bytes, memory_bytes_per_rank=memory, on_host=list(on_host),
        after_peak=list(after_peak),
        largest_batch_size=largest_batch, usable_bytes_per_gpu=usable, host_bytes_per_node=host_bytes,
        comm_bytes_per_step=comm,
        flops_per_step=model_flops, bubble=bubble(layout, schedule_microbatches(layout, args)),
        step_time_s=step_time, step_time_terms_s=terms, dominant=max(terms, key=terms.get),
        mfu=model_flops / (step_time * layout.world * peak), tokens_per_s=step_tokens / step_time,
    )
    if peak_bytes > usable:
        plan["reason"] = f"does not fit: {size(peak_bytes)} a GPU at the peak of a step, {size(usable)} usable"
    elif not plan["fits"]:
        held = " and ".join(what for what, on in (("the offloaded states", layout.cpu_offload),
                                                  ("the checkpoint's staging copy", layout.async_checkpoint))
                            if on)
        plan["reason"] = (f"does not fit: {held} need {size(host_bytes)} of CPU memory a node, which has "
                          f"{size(args.host_memory_gb * GB)}")
    if layout.chapter == "05":
        plan["pretrained_load"] = pretrained_read(layout, config, shapes, args.model, busiest)
    return plan


@functools.cache
def stored_tensors(folder):
    """{name: (dtype, bytes)} of the tensors in a folder's safetensors files, from their headers."""
    stored = {}
    for file in sorted(name for name in os.listdir(folder) if name.endswith(".safetensors")):
        with safe_open(os.path.join(folder, file), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                if tensor.get_dtype() not in STORED_DTYPES:
                    sys.exit(f"error: {file} stores {name} as {tensor.get_dtype()}, a dtype the planner does not "
                             "size; plan with a folder that holds only the model's config.json")
                dtype = STORED_DTYPES[tensor.get_dtype()]
                stored[name] = (str(dtype).removeprefix("torch."), dtype.itemsize * math.prod(tensor.get_shape()))
    return stored


def pretrained_read(layout, config, shapes, model, rank):
    """What a rank of chapter 05 reads with --from-pretrained: its rows of every weight, in the dtype each is
    stored in: the safetensors headers beside the config (safe_open reads no weights), else config.json's dtype
    (a Hub id, or a folder of configs). Chapter 04's load holds the whole fp32 model on rank 0."""
    folder = model if os.path.isdir(model) else os.path.dirname(os.path.abspath(model)) \
        if os.path.isfile(model) else None
    stored = stored_tensors(folder) if folder else {}
    configured = str(getattr(text_config(config), "dtype", None) or "").removeprefix("torch.")
    configured = configured if isinstance(getattr(torch, configured, None), torch.dtype) else ""
    read, dtypes, sources = 0, set(), set()
    for name, shape in shapes:
        if name in stored:
            (dtype, stored_bytes), source = stored[name], "the safetensors headers"
        else:
            dtype, source = configured or "bfloat16", "config.json's dtype" if configured else "an assumption"
            stored_bytes = getattr(torch, dtype).itemsize * math.prod(shape)
        # a rank's rows of a weight are that share of its bytes (dim-0 rows lie together in the file)
        read += stored_bytes * local_numel(name, shape, layout, rank) // math.prod(shape)
        dtypes.add(dtype)
        sources.add(source)
    return {"bytes_per_rank": read, "dtypes": sorted(dtypes), "dtypes_from": sorted(sources),
            "chapter_04_rank_0_bytes": 4 * sum(math.prod(shape) for _, shape in shapes)}


def largest_batch_size(layout, config, shapes, args, rank, off_gpu, usable):
    """The largest -b whose peak fits on the rank (the micro-batches a step kept): a bisection, as the peak's
    moment can move with -b (with checkpointing, from the last layer's backward to the first's)."""
    def peak(batch_size):
        scaled = argparse.Namespace(**{**vars(args), "batch_size": batch_size, "global_batch_size":
                                       global_batch(layout, args) // args.batch_size * batch_size})
        memory = memory_per_rank(layout, config, shapes, scaled, rank)
        return sum(bytes_ for part, bytes_ in memory.items() if part not in off_gpu)

    fitting, too_many = 0, 1
    while peak(too_many) <= usable:
        fitting, too_many = too_many, 2 * too_many
    while too_many - fitting > 1:
        middle = (fitting + too_many) // 2
        fitting, too_many = (middle, too_many) if peak(middle) <= usable else (fitting, middle)
    return fitting


def gradients_at_peak(layout, args):
    """Whether a step's gradients are alive at its peak, the start of its first backward: zero_grad(set_to_none=
    True) frees them before the step, and only DDP's buckets (02) or an earlier micro-batch's backward (gradient
    accumulation) bring them back by then. (A pipeline's: memory_per_rank's gradients_at_the_peak.)"""
    accumulated = global_batch(layout, args) // (layout.dp * args.batch_size) > 1
    return layout.chapter == "02" or (layout.pp == 1 and accumulated)


def step_time_terms(layout, config, shapes, args, comm, model_flops, busiest):
    """Seconds of a step, by what takes them: the compute (at --compute-efficiency of the peak), the pipeline
    bubble, each collective that waits for the compute or it for them (tensor, context and expert parallel,
    pipeline sends), FSDP's and DDP's only beyond the compute they overlap, and CPU offload's work."""
    gpu = GPUS[args.gpu]
    peak = args.peak_tflops * 1e12 if args.peak_tflops else gpu["peak_flops"]
    bandwidth = {"intra_node": (args.intra_node_gb_per_s or gpu["intra_node_gb_per_s"]) * 1e9,
                 "inter_node": (args.inter_node_gb_per_s or gpu["inter_node_gb_per_s"]) * 1e9}
    seconds = {collective: sum(bytes_ / bandwidth[link] for link, bytes_ in by_link.items())
               for collective, by_link in comm.items()}
    if layout.cpu_offload:
        # FSDP copies each fp32 shard to the GPU for every gather and each gradient shard back; AdamW then reads
        # 16 and writes 12 bytes an element in host memory, after the backward
        elements = rank_weights(layout, config, shapes, busiest)[0]
        micro_steps = global_batch(layout, args) // (layout.dp * args.batch_size)
        seconds["PCIe copies (FSDP offload)"] = micro_steps * 12 * elements / (gpu["pcie_gb_per_s"] * 1e9)
        seconds["AdamW on the CPU (offload)"] = 28 * elements / (args.host_adam_gb_per_s * 1e9)
    # activation checkpointing runs each forward twice: 8 FLOPs a weight and token instead of 6
    rank_flops = model_flops / layout.world * (8 / 6 if layout.activation_checkpointing else 1)
    compute = rank_flops / (peak * args.compute_efficiency)
    idle = bubble(layout, schedule_microbatches(layout, args))
    overlapping = sum(time for collective, time in seconds.items() if overlaps_compute(collective))
    return {"compute": compute, "pipeline bubble": compute * idle / (1 - idle),
            "data-parallel communication beyond the compute": max(0.0, overlapping - compute),
            **{collective: time for collective, time in seconds.items() if not overlaps_compute(collective)}}


def overlaps_compute(collective):
    """FSDP's, HSDP's and DDP's collectives run while the GPU computes (prefetch, gradient buckets)."""
    return any(kind in collective for kind in ("FSDP", "HSDP", "DDP"))


def commands(layout, args):
    """The chapter's command for this layout, from the current folder (where a local -m is): torchrun on every
    node, or sbatch with chapter 03's job file (which starts torchrun on every node)."""
    script = os.path.relpath(os.path.join(ROOT, CHAPTER_FOLDERS[layout.chapter], "train_llm.py"))
    job = os.path.relpath(os.path.join(ROOT, CHAPTER_FOLDERS["03"], "job.sbatch"))
    flags = " ".join(chapter_flags(layout, args, model_for_flags(args.model)))
    rendezvous = "" if args.nodes == 1 else (f"--nnodes={args.nodes} --rdzv-backend=c10d "
                                             "--rdzv-endpoint=$HEAD_NODE:29500 ")
    return {"torchrun": f"torchrun {rendezvous}--nproc_per_node={args.gpus_per_node} {script} {flags}",
            "sbatch": f"mkdir -p logs && TRAIN_SCRIPT=$PWD/{script} sbatch --nodes={args.nodes} "
                      f"--gpus-per-node={args.gpus_per_node} {job} {flags}"}


# --- Printing -------------------------------------------------------------------------------------------------


def size(n):
    """n bytes with the precision a reader needs: 1623 GB, 12.68 GB, 0.54 GB, 3.44 MB."""
    for unit, scale in (("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if n >= 0.1 * scale:
            return f"{n / scale:.0f} {unit}" if n >= 1000 * scale else f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def describe(layout):
    parts = [f"chapter {layout.chapter}: dp {layout.dp}"]
    parts += [f"{name} {getattr(layout, name)}" for name in ("tp", "pp", "cp", "ep") if getattr(layout, name) > 1]
    parts += [f"HSDP x{layout.replicate_degree}"] if layout.replicate_degree > 1 else []
    parts += [f"{layout.schedule} (m {layout.num_microbatches})"] if layout.schedule else []
    parts += ["activation checkpointing"] if layout.activation_checkpointing else []
    parts += ["CPU offload"] if layout.cpu_offload else []
    parts += ["explicit prefetch"] if layout.explicit_prefetch else []
    parts += ["async checkpoint"] if layout.async_checkpoint else []
    return ", ".join(parts)


def layout_of(plan):
    return Layout(**{name: value for name, value in plan["layout"].items() if name != "dp"})


def print_plans(plans, config, shapes, args):
    world = args.nodes * args.gpus_per_node
    total = sum(math.prod(shape) for _, shape in shapes)
    print(f"{type(meta_model(config)).__name__}, {total / 1e9:.2f}B parameters, on {args.nodes} nodes x "
          f"{args.gpus_per_node} {args.gpu.upper()} ({world} ranks); -s {args.seq_length}, -b {args.batch_size} "
          f"rows a forward, {args.global_batch_size or world * args.batch_size} sequences a step")
    if len(plans) == 1:  # a pinned layout
        print_plan(plans[0], args)
        if not plans[0]["fits"]:
            print(f"{'note' if args.dry_run else 'error'}: {describe(layout_of(plans[0]))}: {plans[0]['reason']}")
        return
    fitting = [plan for plan in plans if plan["fits"]]
    print(f"{len(fitting)} of {len(plans)} layouts fit; the fastest {min(len(fitting), args.top)}:")
    for plan in fitting[:args.top]:
        print_plan(plan, args)
    others = [plan for plan in plans if not plan["fits"]]
    if others:
        print(f"\n{len(others)} do not fit or cannot run, e.g.:")
        for plan in sorted(others, key=lambda plan: plan["peak_bytes_per_rank"] or math.inf)[:args.top]:
            print(f"  {describe(layout_of(plan))}: {plan['reason']}")


def print_plan(plan, args):
    if plan["peak_bytes_per_rank"] is None:
        return
    print(f"\n{describe(layout_of(plan))}\n  {size(plan['peak_bytes_per_rank'])} a GPU at the peak (rank "
          f"{plan['busiest_rank']} holds the most); step {plan['step_time_s']:.2f} s, MFU {plan['mfu']:.0%}, "
          f"bubble {plan['bubble']:.0%}; the largest term: {plan['dominant']}")
    for part, bytes_ in plan["memory_bytes_per_rank"].items():
        where = ("CPU" if part in plan["on_host"] else
                 "GPU, after the peak" if part in plan["after_peak"] else "GPU")
        print(f"    {part.replace('_', ' '):<22} {size(bytes_):>10}  on the {where}")
    for collective, by_link in plan["comm_bytes_per_step"].items():
        links = ", ".join(f"{size(bytes_)} {link.replace('_', '-')}" for link, bytes_ in by_link.items())
        print(f"    {collective:<46} {links} a step")
    print(f"    {'the largest -b to fit':<22} {plan['largest_batch_size'] or 'none':>10}")
    if plan["on_host"]:
        host = size(plan["host_bytes_per_node"])
        print(f"    {'on the CPU, a node':<22} {host:>10}  of {args.host_memory_gb:g} GB")
    if "pretrained_load" in plan:
        load = plan["pretrained_load"]
        print(f"    {'--from-pretrained':<22} {size(load['bytes_per_rank']):>10}  read by each rank (its rows, in "
              f"{' + '.join(load['dtypes'])} per {' and '.join(load['dtypes_from'])}; chapter 04's load holds "
              f"{size(load['chapter_04_rank_0_bytes'])} on rank 0)")
    print(f"  {plan['command']['torchrun']}\n  {plan['command']['sbatch']}")


# --- The dry run: the chapter's own functions, on the meta device, at the full world size ---------------------


def build_rank(layout, config, args, rank):
    """What rank `rank` of the layout holds once the chapter's functions have built it on the meta device under
    torch's fake process group (collectives return at once): (weight elements, weight tensors, optimizer bytes).
    The calls are the chapter's main() up to its optimizer, with the meta device for the GPU."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    module, chapter, world = chapter_module(layout.chapter), layout.chapter, layout.world
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        chapter_args = module.get_parser().parse_args(chapter_flags(layout, args, model_for_flags(args.model)))
    # --cpu-offload places the states in host memory, which the meta device would then really allocate: the
    # shards are the same without it
    chapter_args.cpu_offload = False
    meta, cpu = torch.device("meta"), torch.device("cpu")
    compute_dtype = getattr(torch, args.dtype)
    dist.init_process_group("fake", rank=rank, world_size=world)
    try:
        if chapter in ("04", "05", "10"):
            mesh = module.make_device_mesh(cpu, world, layout.replicate_degree)
            holders = [module.build_model(chapter_args, config, meta, mesh, compute_dtype)]
        elif chapter == "11":
            mesh = module.make_device_mesh(cpu, world, layout.replicate_degree)
            expert_mesh = init_device_mesh("cpu", (world // layout.ep, layout.ep), mesh_dim_names=("edp", "ep"))
            holders = [module.build_model(chapter_args, config, meta, mesh, expert_mesh, compute_dtype)]
        elif chapter in ("02", "06", "07"):
            model = module.build_model(chapter_args, config, meta)
            if chapter == "06":
                module.tensor_parallelize(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
            elif chapter == "07":
                mesh = init_device_mesh("cpu", (world // layout.tp, layout.tp), mesh_dim_names=("dp", "tp"))
                module.tensor_parallelize(model, mesh["tp"])
                module.shard_model(model, mesh["dp"], compute_dtype)
            holders = [model]
        elif chapter == "08":
            model = module.build_model(chapter_args, config, meta)
            num_stages = world * layout.stages_per_rank
            stage_ranks = module.stage_placement(num_stages, world, layout.schedule)
            indices = [index for index, stage_rank in enumerate(stage_ranks) if stage_rank == rank]
            holders = [module.pipeline_stage(model, index, num_stages) for index in indices]
            if model.get_output_embeddings().weight is model.get_input_embeddings().weight and world > 1:
                module.tied_weight_copies(holders, 0 in indices, num_stages - 1 in indices)
        else:  # "09"
            model = module.build_model(chapter_args, config, meta)
            mesh = init_device_mesh("cpu", (layout.pp, layout.dp, layout.tp), mesh_dim_names=("pp", "dp", "tp"))
            module.tensor_parallelize(model, mesh["tp"])
            num_stages = layout.pp * layout.stages_per_rank
            indices = list(range(mesh.get_local_rank("pp"), num_stages, layout.pp))
            holders = [module.pipeline_stage(model, index, num_stages) for index in indices]
            for stage in holders:
                module.shard_model(stage, mesh["dp"], compute_dtype)
        params = list({id(p): p for holder in holders for p in holder.parameters()}.values())
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        for param in params:
            param.grad = torch.zeros_like(param)
        optimizer.step()  # AdamW's state, on meta tensors: shapes and no storage
        local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
        state = [tensor.to_local() if hasattr(tensor, "to_local") else tensor
                 for per_weight in optimizer.state.values() for tensor in per_weight.values()]
        return (sum(t.numel() for t in local), len(local), sum(t.numel() * t.element_size() for t in state))
    finally:
        dist.destroy_process_group()


def dry_run(layout, config, plan, args):
    """Build the ranks asked for and hold what they hold against the plan; a list of the differences."""
    if plan["refused"]:
        print(f"dry run: not built, the layout is refused: {plan['reason']}")
        return [plan["reason"]]
    shapes = parameter_shapes(config)
    ranks = args.dry_run_ranks or sorted({0, plan["busiest_rank"]})
    if not all(0 <= rank < layout.world for rank in ranks):
        sys.exit(f"error: --dry-run-ranks {' '.join(map(str, ranks))}: the layout has ranks 0 to "
                 f"{layout.world - 1}")
    failures = []
    print(f"\ndry run of {describe(layout)} at {layout.world} ranks (fake process group, meta device):")
    for rank in ranks:
        start = time.perf_counter()
        elements, tensors, optimizer_bytes = build_rank(layout, config, args, rank)
        built = {"weights": 4 * elements, "gradients": 4 * elements, "optimizer": optimizer_bytes}
        predicted = state_bytes(*rank_weights(layout, config, shapes, rank))
        for part in built:
            same = built[part] == predicted[part]
            failures += [] if same else [f"rank {rank} {part}: built {built[part]}, planned {predicted[part]}"]
            print(f"  rank {rank}: {part:<10} built {built[part]:>15,} bytes, planned {predicted[part]:>15,}  "
                  + ("equal" if same else "DIFFERENT"))
        print(f"  rank {rank}: built in {time.perf_counter() - start:.1f} s")
    return failures


if __name__ == "__main__":
    main()
