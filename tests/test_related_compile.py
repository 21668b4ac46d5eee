"""related-topics/torch-compile: chapter 02 (DDP) on 2 ranks with --compile trains to the same losses as
eager, and the compiled graph goes through TorchDynamo's DDPOptimizer, which splits it at DDP's buckets.
One compiled launch (a cold compile costs about 20 s on a 2-core CPU); the eager run is chapter 02's own test
run, shared with tests/test_02_ddp.py when both run in one session."""
import re

from conftest import assert_same_training


def test_ddp_with_compile_trains_to_the_eager_losses(launch_once, common_args):
    args = [*common_args, "-b", 32, "--num-epochs", 2]
    eager = launch_once("02", args, nproc=2)
    compiled = launch_once("02", [*args, "--compile"], nproc=2,
                           env={"TORCH_LOGS": "torch._dynamo.backends.distributed"})

    assert eager.losses[-1] < eager.losses[0] - 0.5
    # inductor fuses elementwise operations and so rounds differently from eager: equal to rounding
    assert_same_training(compiled, eager, 20)
    # compiled after the wrap, the graph went through DDPOptimizer, which cuts it at DDP's buckets (this
    # model's 0.4 MB fit in DDP's first bucket, so it makes one; the README shows two for the default model)
    assert re.search(r"DDPOptimizer used bucket cap \d+ and created \d+ buckets", compiled.stderr), (
        compiled.stderr[-3000:])
