"""pretrain_gpt's loop with context parallelism against the single-process run (fp32, no dropout): 8
iterations of losses to 1e-5 relative at cp2, cp4, cp2 a2a / allgather, cp4 a2a+p2p (2 x 2), cp2 x tp2 with
sequence parallelism, cp2 x pp2 and cp2 x dp2 with ZeRO-3; a checkpoint saved at cp2 x tp2 continues at cp1;
bad input exits 2."""
import pytest
import torch

from tests.integration.test_reliability import TINY, run_main
from tests.recipe import RECIPE

BASE = [*RECIPE, "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "8", "--lr", "1e-3",
        "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--eval-interval", "1000", "--log-interval", "1000",
        "--seed", "7"]
ROPE_GQA = ["--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups", "2"]


def _train(argv):
    from megatron_core.training.arguments import parse_args
    from megatron_core.training.loop import pretrain
    return pretrain(parse_args(BASE + list(argv)))


@pytest.fixture(scope="module")
def references(distributed):
    return {"learned": distributed(1, _train, [])[0], "rope-gqa": distributed(1, _train, ROPE_GQA)[0]}


def _cp(size, *extra):
    return ["--context-parallel-size", str(size), *extra]


LAYOUTS = {  # name: (world size, flags, reference)
    "cp2": (2, _cp(2), "learned"),
    "cp4": (4, _cp(4), "learned"),
    "cp2-a2a": (2, _cp(2, "--cp-comm-type", "a2a", *ROPE_GQA), "rope-gqa"),
    "cp2-allgather": (2, _cp(2, "--cp-comm-type", "allgather", *ROPE_GQA), "rope-gqa"),
    "cp4-p2p-rope-gqa": (4, _cp(4, *ROPE_GQA), "rope-gqa"),
    "cp4-a2a+p2p-rope-gqa": (4, _cp(4, "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2",
                                    *ROPE_GQA), "rope-gqa"),
    "cp2-tp2-sp": (4, _cp(2, "--tensor-model-parallel-size", "2", "--sequence-parallel"), "learned"),
    "cp2-recompute-core-attn": (2, _cp(2, "--recompute-activations"), "learned"),
    "cp2-pp2": (4, _cp(2, "--pipeline-model-parallel-size", "2"), "learned"),
    "cp2-dp2-zero3": (4, _cp(2, "--zero-stage", "3"), "learned"),
    "cp2-dp2-zero1-per-token": (4, _cp(2, "--use-distributed-optimizer", "--calculate-per-token-loss"), "learned"),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_losses_match_single_process(distributed, references, name):
    world, argv, reference = LAYOUTS[name]
    losses = distributed(world, _train, argv)[0]
    assert len(losses) == 8 and losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(references[reference]), rtol=1e-5, atol=0)


def test_checkpoint_from_cp2_tp2_continues_at_cp1(distributed, tmp_path):
    uninterrupted = distributed(1, _train, ["--train-iters", "10"])[0]
    distributed(4, _train, [*_cp(2, "--tensor-model-parallel-size", "2"), "--save", str(tmp_path),
                            "--train-iters", "10", "--exit-interval", "6"])
    resumed = distributed(1, _train, ["--load", str(tmp_path), "--train-iters", "10"])[0]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(uninterrupted[6:]), rtol=1e-5, atol=0)


BAD = {
    "sequence not divisible by 2 cp": (["--context-parallel-size", "4", "--seq-length", "36"],
                                       "--seq-length 36 is not divisible by 2 x --context-parallel-size 4 = 8"),
    "heads not divisible for a2a": (["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--group-query-attention",
                                     "--num-query-groups", "2"],
                                    "4 query heads and 2 key/value groups"),
    "unknown comm type": (["--context-parallel-size", "2", "--cp-comm-type", "ring"],
                          "--cp-comm-type ring: choose from p2p, a2a, allgather, a2a+p2p"),
    "zero cp": (["--context-parallel-size", "0"], "--context-parallel-size must be >= 1, got 0"),
    "cp larger than the world": (["--context-parallel-size", "2"], "context_parallel_size 2"),
    "a2a+p2p without levels": (["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"],
                               "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P"),
    "levels not multiplying to cp": (["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p",
                                      "--hierarchical-context-parallel-sizes", "2", "2"],
                                     "product --context-parallel-size 2"),
    "a2a level not dividing heads": (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                                      "--hierarchical-context-parallel-sizes", "4 1", "--group-query-attention",
                                      "--num-query-groups", "2"], "--num-query-groups 2 must be divisible by tp 1 x 4"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_context_parallel_input_exits_2(distributed, name):
    argv, fragment = BAD[name]
    status, err = distributed(1, run_main, [*TINY, "--train-iters", "2", *argv])[0]
    assert status == 2, err
    assert fragment in err, err
    assert "Traceback" not in err
