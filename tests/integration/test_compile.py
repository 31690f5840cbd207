"""--compile (regional torch.compile of each transformer layer, inductor's C++ backend on CPU) against the eager
run of the same layout: fp32 losses of 4 AdamW iterations to 1e-5 relative, at tp 2 with sequence parallelism
and selective recompute, pp 2 (1F1B with full recompute, and interleaved), dp 2 with ZeRO-2 (overlapped grad
reduction) and ZeRO-3 (the gather hooks stay outside the compiled layers). The kernels' Triton paths are
tested in tests/kernels; here every op runs its torch path, which is what a compiled layer runs inside."""
import os
import tempfile

import pytest
import torch

from tests.recipe import RECIPE

BASE = [*RECIPE, "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4", "--lr", "1e-3",
        "--min-lr", "1e-4", "--eval-interval", "1000", "--log-interval", "1000", "--seed", "7"]
LAYOUTS = {
    "tp2-sp-selective-recompute": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                   "--recompute-activations", "--recompute-modules", "core_attn", "mlp"],
    "pp2-1f1b-full-recompute": ["--pipeline-model-parallel-size", "2", "--recompute-granularity", "full",
                                "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "pp2-interleaved": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
    "pp2-zero-bubble": ["--pipeline-model-parallel-size", "2", "--enable-zero-bubble", "--zero-bubble-defer", "all"],
    "dp2-zero2-overlap": ["--zero-stage", "2", "--overlap-grad-reduce"],
    "dp2-zero3": ["--zero-stage", "3"],
}


def _eager_and_compiled(argv):
    """Runs on every rank: the eager losses, the --compile losses, and what dynamo compiled."""
    import torch._dynamo
    import torch._inductor.config

    from megatron_core.training.arguments import parse_args
    from megatron_core.training.loop import pretrain

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"megatron_core_inductor_{os.getuid()}")
    torch._inductor.config.compile_threads = 1  # no compile worker pool inside the test's worker processes
    eager = pretrain(parse_args(BASE + argv))
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = pretrain(parse_args(BASE + argv + ["--compile"]))
    return eager, compiled, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_layers_match_eager(distributed, name):
    results = distributed(2, _eager_and_compiled, LAYOUTS[name])
    for rank, (eager, compiled, graphs, breaks) in enumerate(results):
        assert graphs >= 1, f"rank {rank}: nothing was compiled"
        assert len(compiled) == 4 and compiled[-1] < compiled[0]
        torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=0,
                                   msg=lambda m: f"{name} rank {rank} ({graphs} graphs, {breaks} breaks): {m}")
