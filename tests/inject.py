"""Run a chapter's train_llm.py unchanged, plus one fault or probe (or two probes) at a known optimizer step.

    INJECT_SCRIPT=<path to train_llm.py> INJECT=<what> [INJECT_RANK=r] [INJECT_AFTER_STEP=k] \
        python tests/inject.py <the script's flags>          # or: torchrun ... tests/inject.py <flags>

INJECT=sigterm        send this rank a real SIGTERM right after its k-th optimizer step (what Slurm sends)
INJECT=sigint         the same with SIGINT (what Ctrl-C sends)
INJECT=sigint-twice   two SIGINTs in a row (Ctrl-C pressed twice)
INJECT=raise          raise RuntimeError on this rank right after its k-th optimizer step
INJECT=kill-in-save   in the k-th torch.save of this launch write half of the file, then SIGKILL this process
                      (a node dying mid-checkpoint: no handler, no cleanup)
INJECT=shard-bytes    after the k-th step, print "rank r: shard_bytes {json}": the bytes of weights, gradients
                      and optimizer state this rank holds, and those of the whole model
INJECT=count-collectives  at exit, print "rank r: collectives {json}": the collectives the script itself calls
                      (through torch.distributed: all_reduce, broadcast, barrier, the object collectives, ...)
                      after each optimizer step, by step (0: before the first)
INJECT=applied-lr     print "rank r: step k lr X" just before each optimizer step: the learning rate it applies
INJECT=sigkill        SIGKILL this rank right after its k-th optimizer step (the OOM killer, a segfault)
INJECT=sigterm-in-write  in the k-th checkpoint write that runs in a background thread (chapter 05's
                      --async-checkpoint), send this rank SIGTERM, and go on writing only once training has taken
                      another optimizer step (a scheduler's warning while a write is in flight)
INJECT=sigkill-in-write  in the k-th such write, SIGKILL this rank once training has taken another optimizer step
                      (a node dying while a write is in flight)
INJECT=save-times     print "inject: rank r: dcp.save blocked S s" (or dcp.async_save) after each such call: how long
                      a checkpoint holds up the training loop (chapter 05's benchmark of --async-checkpoint)
INJECT=nan            fill every weight this rank holds with NaN right after its k-th optimizer step (training
                      that diverged: the next forward pass gives a NaN loss)
INJECT=fill-disk      fill the file system of the folder INJECT_FILL_DIR right after the k-th optimizer step (a
                      file "filler" there takes all its free space), so that the next write there fails
INJECT=kept-outputs   after the k-th step, print "rank r: kept_output_chunks N": the micro-batch outputs that this
                      rank's pipeline stages still hold (a schedule keeps each one unless told not to)
INJECT=ddp-all-reduces  at exit, print "rank r: ddp_all_reduces {json}": the gradient all-reduces DDP ran (its
                      buckets), by optimizer step (1 = the first)
INJECT=replica-hashes  at exit, print "rank r: replica_hashes {json}": for each weight this rank's optimizer
                      steps, in order, a hash of its local values and which mesh dimensions replicate it (the
                      copies that tensor parallelism keeps of a norm's weight must stay equal bit for bit)
INJECT=label-counts   at exit, print "rank r: label_counts [n, ...]": the label tokens (not -100) of each
                      cross_entropy call, in order (one a micro-batch in chapter 01)
INJECT=rows           at exit, print "rank r: rows {json}": the token rows the model read in training and in
                      evaluation, in order (hashes of the input_ids rows of each forward of the whole model)
INJECT=slow-p2p       sleep 50 ms before each batch of point-to-point sends and receives of this rank (a slow
                      link or NIC, for diagnosing-errors/tools/bandwidth.py --check)
INJECT=expert-bytes  at exit, print "rank r: expert_bytes {json}": the bytes of expert weights this rank held
                      while an MoE layer's experts computed (the most of any layer; FSDP has gathered them then),
                      and those of a whole layer's experts
INJECT=all-to-all-bytes  at exit, print "rank r: all_to_all_bytes {json}": the bytes this rank sent to other
                      ranks through all_to_all_single (rows times row bytes), by optimizer step (1 = the first);
                      a validation pass under "validation after k"
INJECT=all-gathers    at exit, print "rank r: all_gathers {json}": the all-gathers of tensors that torch runs for
                      this rank (FSDP's weights), by optimizer step (1 = the first): [group size, bytes] each
INJECT=saved-activations  at exit, print "rank r: saved_activation_bytes N": the most bytes that autograd
                      held for backward at once in training (tensors saved by the forward, not the weights):
                      what a pipeline schedule's order of forwards and backwards costs in activation memory
INJECT=collective-bytes  at exit, print "rank r: collective_bytes {json}": every collective this rank ran, by
                      optimizer step (1 = the first): [op, group size, bytes in, bytes out] each, seen where torch
                      dispatches it (c10d's ops, also those DDP's reducer and FSDP run, and the functional ones
                      that DTensor runs), for chapter 12's count of what a layout sends (torch's causal masks,
                      CausalBias, a tensor subclass that cannot be made under a dispatch mode, are made outside it)
INJECT=tensor-bytes   at exit, print "rank r: tensor_bytes {json}": the most bytes of tensor storage alive at once
                      in step 2 ("peak"; from its first forward, after zero_grad, to the end of its optimizer
                      step), counting those alive at its start, each storage torch's ops make until it is freed,
                      and those FSDP resizes in place (chapter 12's check of the planned peak; not RSS)
INJECT=collective-bytes,tensor-bytes  both probes in one run (chapter 12's two checks share a launch)
INJECT=slow-alone     while the job has one rank (WORLD_SIZE=1), sleep 1 s after each step from the k-th on, so
                      that a one-node run cannot end before a second node (that a test starts) joins it

INJECT_ROUTING=balanced  (beside any INJECT) the experts' forwards registered with transformers from then on
                      (chapter 11's) send token t to experts (t k + j) mod E, j < k, in place of the router's
                      choice: each expert gets as many rows as any other, as from a perfectly balanced router
                      (chapter 12's planner counts the exchange for one)

Only rank INJECT_RANK (default: every rank) is affected, and only in the first start of the workers
(TORCHELASTIC_RESTART_COUNT 0): workers that torchrun --max-restarts starts again run clean, as after a real
crash. Steps are counted with torch's public global
optimizer hook, so the chapter script runs as __main__ exactly as `python train_llm.py` would run it: the
signals are real, the save is torch.save's own bytes cut short. Not collected by pytest (no test_ prefix).
"""
import gc
import io
import json
import os
import runpy
import shutil
import signal
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

script = os.path.abspath(os.environ["INJECT_SCRIPT"])
what = os.environ["INJECT"]
after_step = int(os.environ.get("INJECT_AFTER_STEP", "1"))
rank = int(os.environ.get("RANK", "0"))
affected = (os.environ.get("INJECT_RANK") in (None, str(rank))
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0")


def say(line):
    # One write with its newline: two ranks' lines on one stream cannot interleave.
    sys.stderr.write(f"inject: {line}\n")
    sys.stderr.flush()


def shard_bytes(optimizer):
    """[bytes on this rank, bytes of the whole model] of weights, gradients and optimizer state."""

    def local_and_full(tensors):
        tensors = list(tensors)
        local = sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)
        return [local, sum(t.numel() * t.element_size() for t in tensors)]

    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {
        "parameters": local_and_full(params),
        "gradients": local_and_full(p.grad for p in params if p.grad is not None),
        "optimizer_state": local_and_full(
            value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)
        ),
    }


steps_done = 0


def count_steps(optimizer, args, kwargs):
    """An optimizer hook for the probes that report by step: steps_done counts the steps taken."""
    global steps_done
    steps_done += 1


def report_at_exit(line):
    """Print "rank r: <line()>" when the script leaves (the chapters leave through os._exit)."""
    real_exit = os._exit

    def report_then_exit(code):
        sys.stdout.write(f"rank {rank}: {line()}\n")
        sys.stdout.flush()
        real_exit(code)

    os._exit = report_then_exit


def make_causal_masks_outside_dispatch_modes():
    """torch's causal masks (CausalBias, a tensor subclass) cannot be created under a dispatch mode: chapter 10's
    are made with the probes' modes off. (Not counted then: a mask's own [2, q, kv] fp32 storage, 1 MB at
    256 x 512, under 1% of chapter 12's measured peaks; it runs no collective.)"""
    import torch.nn.attention.bias
    from torch.utils._python_dispatch import _disable_current_modes

    real_causal_lower_right = torch.nn.attention.bias.causal_lower_right

    def causal_lower_right(*args, **kwargs):
        with _disable_current_modes():
            return real_causal_lower_right(*args, **kwargs)

    torch.nn.attention.bias.causal_lower_right = causal_lower_right


def after_optimizer_step(optimizer, args, kwargs):
    global steps_done
    steps_done += 1
    if what == "slow-alone":
        if steps_done >= after_step and os.environ["WORLD_SIZE"] == "1":
            time.sleep(1)
        return
    if not affected or steps_done != after_step:
        return
    if what == "shard-bytes":
        sys.stdout.write(f"rank {rank}: shard_bytes {json.dumps(shard_bytes(optimizer))}\n")
        sys.stdout.flush()
        return
    if what == "kept-outputs":
        from torch.distributed.pipelining.stage import _PipelineStageBase

        stages = [obj for obj in gc.get_objects() if isinstance(obj, _PipelineStageBase)]
        kept = sum(len(stage.output_chunks) for stage in stages)
        sys.stdout.write(f"rank {rank}: kept_output_chunks {kept} in {len(stages)} stages\n")
        sys.stdout.flush()
        return
    # The wall-clock time lets a test measure how long the job takes to end after the fault.
    say(f"{what} on rank {rank} after step {steps_done} at {time.time():.3f}")
    if what == "fill-disk":
        with open(os.path.join(os.environ["INJECT_FILL_DIR"], "filler"), "wb") as filler:
            os.posix_fallocate(filler.fileno(), 0, shutil.disk_usage(os.environ["INJECT_FILL_DIR"]).free)
        return
    if what == "nan":
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    (param.to_local() if isinstance(param, DTensor) else param).fill_(float("nan"))
        return
    if what == "raise":
        raise RuntimeError(f"injected failure on rank {rank} after step {steps_done}")
    if what == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(2 if what == "sigint-twice" else 1):
        os.kill(os.getpid(), signal.SIGTERM if what == "sigterm" else signal.SIGINT)


def count_collective_bytes():
    """INJECT=collective-bytes (steps counted by count_steps, registered first)."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.utils._python_dispatch import TorchDispatchMode

    ran_by_step = {}

    def group_size(args):
        """The size of the group a collective runs on: a ProcessGroup argument (c10d's ops) or a group's name
        (the functional ops; no public call maps a name to its group)."""
        for arg in args:
            if isinstance(arg, torch.ScriptObject) and arg._type().name() == "ProcessGroup":
                return dist.ProcessGroup.unbox(arg).size()
        return _resolve_process_group(next(arg for arg in reversed(args) if isinstance(arg, str))).size()

    def tensor_bytes(arg):
        if isinstance(arg, (list, tuple)):
            return sum(map(tensor_bytes, arg))
        return arg.numel() * arg.element_size() if torch.is_tensor(arg) else 0

    # c10d's ops that take (outputs, inputs, group, ...); the others reduce, broadcast or send in place
    OUTPUT_FIRST = ("_allgather_base_", "allgather_", "allgather_coalesced_",
                    "allgather_into_tensor_coalesced_", "_reduce_scatter_base_", "reduce_scatter_",
                    "reduce_scatter_tensor_coalesced_", "alltoall_base_", "alltoall_", "gather_", "scatter_")

    class CountCollectives(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(kind, DTensor) for kind in types):
                return NotImplemented  # DTensor runs the op with this mode still on: its collectives count too
            out = func(*args, **(kwargs or {}))
            name = func.__name__.split(".")[0]
            if func.namespace == "c10d" or (func.namespace == "_c10d_functional" and
                                            not name.startswith(("wait", "_wrap"))):
                if func.namespace == "_c10d_functional":
                    sizes = tensor_bytes(args[0]), tensor_bytes(out)
                elif name in OUTPUT_FIRST:
                    sizes = tensor_bytes(args[1]), tensor_bytes(args[0])
                else:
                    sizes = tensor_bytes(args[0]), tensor_bytes(args[0])
                ran_by_step.setdefault(steps_done + 1, []).append([name, group_size(args), *sizes])
            return out

    CountCollectives().__enter__()
    report_at_exit(lambda: f"collective_bytes {json.dumps(ran_by_step)}")


def track_tensor_bytes():
    """INJECT=tensor-bytes (steps counted by count_steps, registered first)."""
    # The most bytes of tensor storage alive at once in step 2 (from its first forward to the end of its
    # optimizer step): the storages alive at the end of step 1 (all that Python reaches), then each new one that
    # an op makes (seen where torch dispatches it) until it is freed, and the storages FSDP resizes in place.
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    live = {}  # id of a storage (torch keeps one Python object per storage for its life): its bytes
    memory = {"now": 0, "peak": 0}

    def track(storage):
        """Count a storage's bytes now (a new one, or one resized in place) and forget them when it dies."""
        if storage.device.type == "meta":
            return
        key = id(storage)
        if key not in live:
            live[key] = 0
            weakref.finalize(storage, forget, key)
        memory["now"] += storage.nbytes() - live[key]
        live[key] = storage.nbytes()
        memory["peak"] = max(memory["peak"], memory["now"])

    def forget(key):
        memory["now"] -= live.pop(key)

    class TrackStorages(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(kind, DTensor) for kind in types):
                return NotImplemented  # DTensor runs its local ops with this mode on: they are tracked
            out = func(*args, **(kwargs or {}))
            for tensor in (out if isinstance(out, (list, tuple)) else [out]):
                if isinstance(tensor, torch.Tensor):
                    track(tensor.untyped_storage())
            return out

    real_resize = torch.UntypedStorage.resize_

    def resize_(storage, size):
        """FSDP frees and allocates a gathered weight's storage in place (resize_ to 0 and back)."""
        result = real_resize(storage, size)
        track(storage)
        return result

    tracking = TrackStorages()
    forward_hooks = []

    def peak_from_here(module, args):
        """Step 2's first forward: the peak counts from here, after zero_grad freed step 1's gradients."""
        memory["peak"] = memory["now"]
        forward_hooks.pop().remove()

    def track_step_2(optimizer, args, kwargs):
        if steps_done == 1:
            gc.collect()
            for obj in gc.get_objects():
                # (type(), not isinstance: a dead weakref.proxy raises on the latter)
                if issubclass(type(obj), torch.Tensor) and obj.layout == torch.strided:
                    track((obj.to_local() if isinstance(obj, DTensor) else obj).untyped_storage())
            memory["start"] = memory["now"]
            torch.UntypedStorage.resize_ = resize_
            tracking.__enter__()
            forward_hooks.append(torch.nn.modules.module.register_module_forward_pre_hook(peak_from_here))
        elif steps_done == 2:
            tracking.__exit__(None, None, None)
            torch.UntypedStorage.resize_ = real_resize
            memory["end"] = memory["now"]

    register_optimizer_step_post_hook(track_step_2)
    report_at_exit(lambda: f"tensor_bytes {json.dumps(memory)}")


if os.environ.get("INJECT_ROUTING") == "balanced":
    from transformers.integrations.moe import ExpertsInterface

    real_register = ExpertsInterface.register

    def register_balanced(name, experts_forward):
        """Register the experts' forward (chapter 11's ExpertParallel) with the router's choice replaced."""

        def balanced(experts, hidden_states, top_k_index, *args, **kwargs):
            tokens, k = top_k_index.shape
            chosen = torch.arange(tokens * k, device=top_k_index.device).view(tokens, k) % experts.num_experts
            return experts_forward(experts, hidden_states, chosen, *args, **kwargs)

        return real_register(name, balanced)

    ExpertsInterface.register = register_balanced

if what in ("sigterm", "sigint", "sigint-twice", "raise", "nan", "fill-disk", "shard-bytes", "sigkill",
            "slow-alone", "kept-outputs"):
    register_optimizer_step_post_hook(after_optimizer_step)
elif what == "kill-in-save":
    real_save, saves_done = torch.save, 0

    def save_then_die_halfway(obj, f, *args, **kwargs):
        global saves_done
        saves_done += 1
        if not affected or saves_done < after_step:
            return real_save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        # The scripts pass an open file (a full disk then raises its OSError); a path would work too.
        with (nullcontext(f) if hasattr(f, "write") else open(f, "wb")) as out:
            out.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            out.flush()
            os.fsync(out.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = save_then_die_halfway
elif what in ("sigterm-in-write", "sigkill-in-write"):
    import threading

    from torch.distributed.checkpoint import FileSystemWriter

    real_write_data, background_writes = FileSystemWriter.write_data, 0
    register_optimizer_step_post_hook(count_steps)

    def write_during_training(self, *args, **kwargs):
        global background_writes
        if threading.current_thread() is not threading.main_thread():
            background_writes += 1
            if affected and background_writes == after_step:
                say(f"{what} on rank {rank} in background write {background_writes} after step {steps_done}")
                if what == "sigterm-in-write":
                    os.kill(os.getpid(), signal.SIGTERM)
                written_after = steps_done
                deadline = time.monotonic() + 60
                while steps_done == written_after and time.monotonic() < deadline:
                    time.sleep(0.01)
                if what == "sigkill-in-write":
                    os.kill(os.getpid(), signal.SIGKILL)
        return real_write_data(self, *args, **kwargs)

    FileSystemWriter.write_data = write_during_training
elif what == "save-times":
    import torch.distributed.checkpoint as dcp

    def timed(name, real_call):
        def call(*args, **kwargs):
            start = time.perf_counter()
            result = real_call(*args, **kwargs)
            say(f"rank {rank}: {name} blocked {time.perf_counter() - start:.2f} s")
            return result

        return call

    # The chapters call dcp.save / dcp.async_save through the module, so replacing its attributes reaches them.
    dcp.save, dcp.async_save = timed("dcp.save", dcp.save), timed("dcp.async_save", dcp.async_save)
elif what == "replica-hashes":
    import hashlib

    stepped = []

    def remember_params(optimizer, args, kwargs):
        stepped[:] = [p for group in optimizer.param_groups for p in group["params"]]

    def replica_hashes():
        hashes = []
        for param in stepped:
            local = param.to_local() if isinstance(param, DTensor) else param
            replicated_over = ([name for name, placement in zip(param.device_mesh.mesh_dim_names, param.placements)
                                if placement.is_replicate()] if isinstance(param, DTensor) else [])
            digest = hashlib.sha1(local.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]
            hashes.append({"hash": digest, "replicated_over": replicated_over})
        return f"replica_hashes {json.dumps(hashes)}"

    register_optimizer_step_post_hook(remember_params)
    report_at_exit(replica_hashes)
elif what == "count-collectives":
    collectives = {}

    def counted(name, real):
        def collective(*args, **kwargs):
            collectives.setdefault(steps_done, []).append(name)
            return real(*args, **kwargs)

        return collective

    # The chapter calls them through the module, so it finds these; what DDP, FSDP and DCP run inside (in C++,
    # or through torch's own modules) is not counted.
    for name in ("all_reduce", "broadcast", "barrier", "monitored_barrier", "all_gather", "all_gather_into_tensor",
                 "reduce_scatter_tensor", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single",
                 "send", "recv", "isend", "irecv", "all_gather_object", "broadcast_object_list", "gather_object",
                 "scatter_object_list"):
        setattr(dist, name, counted(name, getattr(dist, name)))

    register_optimizer_step_post_hook(count_steps)
    report_at_exit(lambda: f"collectives {json.dumps(collectives)}")
elif what == "applied-lr":
    def report_lr(optimizer, args, kwargs):
        sys.stdout.write(f"rank {rank}: step {steps_done + 1} lr {optimizer.param_groups[0]['lr']!r}\n")
        sys.stdout.flush()

    register_optimizer_step_pre_hook(report_lr)
    register_optimizer_step_post_hook(count_steps)
elif what == "ddp-all-reduces":
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    all_reduces, real_init = {}, DistributedDataParallel.__init__

    def counted_hook(state, bucket):
        all_reduces[steps_done + 1] = all_reduces.get(steps_done + 1, 0) + 1
        return allreduce_hook(state, bucket)

    def init_with_counting_hook(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        # DDP's default all-reduce, with a count: a comm hook is DDP's public way to see each bucket's all-reduce.
        self.register_comm_hook(self.process_group, counted_hook)

    DistributedDataParallel.__init__ = init_with_counting_hook
    register_optimizer_step_post_hook(count_steps)
    report_at_exit(lambda: f"ddp_all_reduces {json.dumps(all_reduces)}")
elif what == "label-counts":
    import torch.nn.functional as F

    label_counts, real_cross_entropy = [], F.cross_entropy

    def counted_cross_entropy(input, target, *args, **kwargs):
        label_counts.append(int((target != -100).sum()))
        return real_cross_entropy(input, target, *args, **kwargs)

    F.cross_entropy = counted_cross_entropy  # the chapters call it through the module
    report_at_exit(lambda: f"label_counts {json.dumps(label_counts)}")
elif what == "rows":
    import hashlib

    seen = {"train": [], "eval": []}

    def record_rows(module, args):
        # (a global hook sees positional arguments only: the chapters pass input_ids by keyword to the model,
        # which passes them on to its embedding)
        input_ids = args[0] if args and isinstance(module, torch.nn.Embedding) else None
        if input_ids is not None and input_ids.dtype == torch.long:
            kind = "train" if torch.is_grad_enabled() else "eval"  # (evaluation runs under no_grad)
            seen[kind].extend(hashlib.sha1(str(row).encode()).hexdigest() for row in input_ids.tolist())

    torch.nn.modules.module.register_module_forward_pre_hook(record_rows)
    report_at_exit(lambda: f"rows {json.dumps(seen)}")
elif what == "all-gathers":
    gathers_by_step = {}

    def counted_all_gather(real):
        def all_gather(output_tensor, input_tensor, group=None, *args, **kwargs):
            gathers_by_step.setdefault(steps_done + 1, []).append(
                [dist.get_world_size(group), output_tensor.numel() * output_tensor.element_size()])
            return real(output_tensor, input_tensor, group, *args, **kwargs)

        return all_gather

    # FSDP calls the one its torch release has through the module (all_gather_into_tensor in torch 2.11,
    # all_gather_single in 2.13 and 2.15)
    for name in ("all_gather_single", "all_gather_into_tensor"):
        if hasattr(dist, name):
            setattr(dist, name, counted_all_gather(getattr(dist, name)))
    register_optimizer_step_post_hook(count_steps)
    report_at_exit(lambda: f"all_gathers {json.dumps(gathers_by_step)}")
elif what == "slow-p2p":
    real_batch_isend_irecv = dist.batch_isend_irecv

    def slow_batch_isend_irecv(ops):
        if affected:
            time.sleep(0.05)
        return real_batch_isend_irecv(ops)

    dist.batch_isend_irecv = slow_batch_isend_irecv
elif what == "expert-bytes":
    held_by_layer = {"held": 0, "layer": 0}

    def record_expert_bytes(module, args, output):
        # A module's own forward hooks run after the global ones: FSDP has not yet freed the gathered weights.
        if hasattr(module, "has_gate") and hasattr(module, "num_experts"):
            weights = list(module.parameters())
            held = sum((w.to_local() if isinstance(w, DTensor) else w).numel() * w.element_size() for w in weights)
            held_by_layer["held"] = max(held_by_layer["held"], held)
            held_by_layer["layer"] = max(held_by_layer["layer"], sum(w.numel() * w.element_size() for w in weights))

    torch.nn.modules.module.register_module_forward_hook(record_expert_bytes)
    report_at_exit(lambda: f"expert_bytes {json.dumps(held_by_layer)}")
elif what == "all-to-all-bytes":
    # bytes this rank sent to other ranks through all_to_all_single, by optimizer step (forward and backward)
    sent_by_step = {}
    real_all_to_all_single = dist.all_to_all_single

    def counted_all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                                  **kwargs):
        group_size, group_rank = dist.get_world_size(group), dist.get_rank(group)
        splits = input_split_sizes or [input.shape[0] // group_size] * group_size
        row_bytes = input[:1].numel() * input.element_size()
        # a validation pass (the model in eval mode) gets a key of its own, not the next training step's
        step = str(steps_done + 1) if in_training_mode[0] else f"validation after {steps_done}"
        sent_by_step[step] = sent_by_step.get(step, 0) + (sum(splits) - splits[group_rank]) * row_bytes
        return real_all_to_all_single(output, input, output_split_sizes, input_split_sizes, group, **kwargs)

    dist.all_to_all_single = counted_all_to_all_single
    in_training_mode = [True]  # the mode of the module that ran last: an exchange runs inside an MoE layer
    torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, inputs: in_training_mode.__setitem__(0, module.training))
    register_optimizer_step_post_hook(count_steps)
    report_at_exit(lambda: f"all_to_all_bytes {json.dumps(sent_by_step)}")
elif set(what.split(",")) <= {"collective-bytes", "tensor-bytes"}:
    # one or both of chapter 12's probes (INJECT=collective-bytes,tensor-bytes: one run serves both checks)
    register_optimizer_step_post_hook(count_steps)
    make_causal_masks_outside_dispatch_modes()
    if "collective-bytes" in what.split(","):
        count_collective_bytes()
    if "tensor-bytes" in what.split(","):
        track_tensor_bytes()
elif what == "saved-activations":
    from torch.nn import Parameter

    held = {"bytes": 0, "peak": 0, "storages": {}}  # storages: {data_ptr: [saved tensors holding it, bytes]}

    class Saved:
        """What the pack hook returns: autograd keeps it until the backward that needs it has run (a split
        backward until its weight half), and drops it then; a storage counts once however many save it."""

        def __init__(self, tensor):
            # detached: a node that saves its own output would otherwise hold itself through this object, a
            # cycle that outlives the step (autograd breaks it only for tensors it saves without hooks)
            self.tensor, self.key = tensor.detach(), tensor.untyped_storage().data_ptr()
            entry = held["storages"].setdefault(self.key, [0, tensor.untyped_storage().nbytes()])
            entry[0] += 1
            if entry[0] == 1:
                held["bytes"] += entry[1]
                held["peak"] = max(held["peak"], held["bytes"])

        def __del__(self):
            entry = held["storages"][self.key]
            entry[0] -= 1
            if entry[0] == 0:
                held["bytes"] -= entry[1]
                del held["storages"][self.key]

    def pack(tensor):
        # a weight (or a view of one, as a linear layer saves it) is memory the model holds anyway
        return tensor if isinstance(tensor, Parameter) or isinstance(tensor._base, Parameter) else Saved(tensor)

    torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved.tensor if isinstance(saved, Saved)
                                             else saved).__enter__()
    report_at_exit(lambda: f"saved_activation_bytes {held['peak']}")
else:
    raise SystemExit(f"inject.py: unknown INJECT={what!r}")

sys.argv = [script, *sys.argv[1:]]
sys.path[0] = os.path.dirname(script)  # as `python train_llm.py` would set it
runpy.run_path(script, run_name="__main__")
