"""pretrain_gpt's loop with --num-experts 4 --moe-router-topk 2 equals the single-process MoE run (8 iterations,
fp32, losses, logged MoE losses and grad norms to 1e-5 relative) at: ep 2 and 4 (alltoall and allgather),
ep2 x tp2 with sequence parallelism, ep2 x pp2, ep2 x cp2 (and x tp2), ep2 x expert-dp 2 with the distributed
optimizer and with ZeRO-3, expert tensor parallelism (etp = tp 2; with ep 2, and with ZeRO-3 at expert-dp 2)
and etp other than 1 or tp (tp 1 x dp 2 etp 2, ep 2 x etp 2 at dp 4, tp 2 x dp 2 etp 4, tp 4 etp 2).
Checkpoints saved at ep 2 continue at ep 1, at ep2 x etp2 at one rank and back, at tp 1 x etp 2 at one rank;
bad MoE input exits 2 naming the values."""
import json
import subprocess
import sys

import pytest
import torch

from tests.recipe import RECIPE

MOE = [*RECIPE, "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
       "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "8", "--lr", "2e-3",
       "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--eval-interval", "1000", "--log-interval", "1000",
       "--seed", "7", "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
       "--moe-z-loss-coeff", "1e-3"]
A2A = ["--moe-token-dispatcher-type", "alltoall"]


def _train(argv):
    from megatron_core.training.arguments import parse_args
    from megatron_core.training.loop import pretrain
    return pretrain(parse_args(MOE + list(argv)))


def _records(path):
    with open(path) as handle:
        return [json.loads(line) for line in handle if '"split"' not in line]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, distributed):
    metrics = tmp_path_factory.mktemp("moe_ref") / "metrics.jsonl"
    losses = distributed(1, _train, ["--metrics-file", str(metrics)])[0]
    return losses, _records(metrics)


def _ep(size):
    return ["--expert-model-parallel-size", str(size)]


TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
LAYOUTS = {
    "ep2": (2, [*_ep(2), *A2A]),
    "ep4": (4, [*_ep(4), *A2A, "--moe-grouped-gemm"]),
    "ep2-allgather": (2, _ep(2)),
    "ep2-tp2-sp": (2, [*_ep(2), *A2A, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                       "--expert-tensor-parallel-size", "1"]),
    "ep2-pp2": (4, [*_ep(2), *A2A, "--pipeline-model-parallel-size", "2"]),
    "ep2-pp2-zero-bubble": (4, [*_ep(2), *A2A, "--pipeline-model-parallel-size", "2", "--enable-zero-bubble",
                                "--zero-bubble-defer", "all"]),
    "ep2-edp2-distopt": (4, [*_ep(2), *A2A, "--use-distributed-optimizer"]),
    "ep2-cp2": (2, [*_ep(2), *A2A, "--context-parallel-size", "2"]),
    "ep2-cp2-tp2-sp": (4, [*_ep(2), "--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
                           "--sequence-parallel", "--expert-tensor-parallel-size", "1"]),
    "etp2-tp2-sp": (2, [*A2A, *TP2_SP, "--expert-tensor-parallel-size", "2"]),
    "ep2-etp2-tp2-sp-distopt": (4, [*_ep(2), *TP2_SP, "--expert-tensor-parallel-size", "2",
                                    "--use-distributed-optimizer"]),
    "etp2-edp2-zero3": (4, [*A2A, *TP2_SP, "--expert-tensor-parallel-size", "2", "--zero-stage", "3"]),
    "ep2-edp2-zero3": (4, [*_ep(2), *A2A, "--zero-stage", "3", "--init-model-with-meta-device", "--moe-grouped-gemm"]),
    # expert tensor parallel sizes other than 1 or tp: the etp group spans dp ranks, several tp groups or part of one
    "etp2-dp2": (2, [*A2A, "--expert-tensor-parallel-size", "2"]),
    "ep2-etp2-dp4-distopt": (4, [*_ep(2), *A2A, "--expert-tensor-parallel-size", "2", "--moe-grouped-gemm",
                                 "--use-distributed-optimizer"]),
    "etp4-tp2-sp-dp2": (4, [*A2A, *TP2_SP, "--expert-tensor-parallel-size", "4"]),
    "etp2-tp4-sp": (4, [*A2A, "--tensor-model-parallel-size", "4", "--sequence-parallel",
                        "--expert-tensor-parallel-size", "2"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_losses_match_single_process(distributed, reference, tmp_path, name):
    world, argv = LAYOUTS[name]
    metrics = tmp_path / "metrics.jsonl"
    losses = distributed(world, _train, [*argv, "--metrics-file", str(metrics)])[0]
    ref_losses, ref_records = reference
    assert len(losses) == 8 and losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    records = _records(metrics)
    for key in ("load_balancing_loss", "z_loss", "grad_norm"):  # logged each step, layout-independent
        torch.testing.assert_close(torch.tensor([r[key] for r in records]),
                                   torch.tensor([r[key] for r in ref_records]), rtol=1e-5, atol=0)


def test_checkpoint_saved_at_ep2_continues_at_ep1(distributed, reference, tmp_path):
    save = ["--save", str(tmp_path), "--exit-interval", "4"]
    first = distributed(2, _train, [*_ep(2), *A2A, *save])[0]
    second = distributed(1, _train, ["--load", str(tmp_path)])[0]
    ref_losses, _ = reference
    torch.testing.assert_close(torch.tensor(first + second), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    names = json.loads(next(tmp_path.glob("iter_*/metadata.json")).read_text())["tensors"]
    assert {f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight" for e in range(4)} <= set(names)


@pytest.mark.parametrize("argv, named", [
    (["--num-experts", "3", "--expert-model-parallel-size", "2"], "--num-experts 3 is not divisible by "
                                                                  "--expert-model-parallel-size 2"),
    (["--num-experts", "4", "--moe-router-topk", "5"], "moe_router_topk 5 must lie in [1, num_moe_experts 4]"),
    (["--num-experts", "4", "--expert-tensor-parallel-size", "0"], "--expert-tensor-parallel-size must be >= 1, "
                                                                   "got 0"),
    (["--num-experts", "4", "--moe-router-num-groups", "2"], "needs both --moe-router-num-groups and "
                                                              "--moe-router-group-topk"),
])
def test_bad_moe_input_exits_2_naming_the_values(argv, named):
    result = subprocess.run([sys.executable, "-c", "from megatron_core.training.arguments import parse_args; "
                             f"parse_args({argv!r})"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert named in result.stderr and "Traceback" not in result.stderr


def test_checkpoint_saved_at_etp2_continues_at_ep1_and_back(distributed, reference, tmp_path):
    """Experts split over etp (= tp 2) are saved as tp shards: 3 iterations at ep2 x etp2 x tp2 with the
    distributed optimizer, 2 at one rank, 3 at etp2 x tp2 equal the uninterrupted single-process run."""
    etp = [*TP2_SP, "--expert-tensor-parallel-size", "2"]
    first = distributed(4, _train, [*_ep(2), *A2A, *etp, "--use-distributed-optimizer", "--save", str(tmp_path),
                                    "--exit-interval", "3"])[0]
    second = distributed(1, _train, ["--load", str(tmp_path), "--save", str(tmp_path), "--exit-interval", "5"])[0]
    third = distributed(2, _train, [*etp, "--load", str(tmp_path)])[0]
    ref_losses, _ = reference
    torch.testing.assert_close(torch.tensor(first + second + third), torch.tensor(ref_losses), rtol=1e-5, atol=0)


SINKHORN = ["--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0"]


def test_checkpoint_saved_at_tp1_etp2_continues_at_etp1(distributed, reference, tmp_path):
    """Experts split over an etp group of dp ranks (tp 1 x dp 2, etp 2) are saved as etp shards: 4 iterations
    there, 4 at one rank (whole experts) equal the uninterrupted single-process run."""
    first = distributed(2, _train, [*A2A, "--expert-tensor-parallel-size", "2", "--save", str(tmp_path),
                                    "--exit-interval", "4"])[0]
    second = distributed(1, _train, ["--load", str(tmp_path)])[0]
    ref_losses, _ = reference
    torch.testing.assert_close(torch.tensor(first + second), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    fc1 = json.loads(next(tmp_path.glob("iter_*/metadata.json")).read_text())["tensors"][
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert fc1["partition_dim"] == 0 and fc1["shards"]["1"]["file"] == "experts_ep000_tp01_pp000.safetensors"


def _etp_too_large(argv):
    try:
        _train(argv)
    except ValueError as error:
        return str(error)


def test_etp_that_does_not_divide_the_stage_is_a_value_error(distributed):
    message = distributed(2, _etp_too_large, [*_ep(2), "--expert-tensor-parallel-size", "2"])[0]
    assert "expert_model_parallel_size 2 x expert_tensor_parallel_size 2 = 4 does not divide the 2 ranks" in message


def test_sinkhorn_routing_is_megatron_cores_and_layout_independent(distributed):
    """--moe-router-load-balancing-type sinkhorn: the balancing is megatron-core's own function bit for bit;
    training at ep 2 x tp 2 (sequence parallel: the balancing sees the whole micro-batch) equals one rank."""
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    from megatron_core.transformer.moe.router import sinkhorn
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(sinkhorn(logits), moe_utils.sinkhorn(logits), rtol=0, atol=0)
    reference = distributed(1, _train, SINKHORN)[0]
    split = distributed(2, _train, [*SINKHORN, *_ep(2), *A2A, *TP2_SP, "--expert-tensor-parallel-size", "1"])[0]
    assert len(reference) == 8 and reference[-1] < reference[0]
    torch.testing.assert_close(torch.tensor(split), torch.tensor(reference), rtol=1e-5, atol=0)


BIAS = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "0.05"]


def test_expert_bias_is_checkpointed_and_resume_is_exact(distributed, tmp_path):
    """--moe-router-enable-expert-bias: the bias (a buffer) is saved per layer and restored, so 3 iterations at
    ep 2 then 5 resumed at ep 1 equal 8 uninterrupted ones."""
    from safetensors import safe_open
    reference = distributed(1, _train, BIAS)[0]
    save = ["--save", str(tmp_path), "--exit-interval", "3"]  # odd: each step moves the bias by +-rate
    first = distributed(2, _train, [*BIAS, *_ep(2), *A2A, *save])[0]
    second = distributed(1, _train, [*BIAS, "--load", str(tmp_path)])[0]
    torch.testing.assert_close(torch.tensor(first + second), torch.tensor(reference), rtol=1e-5, atol=0)
    folder = next(tmp_path.glob("iter_*"))
    entries = json.loads((folder / "metadata.json").read_text())["tensors"]
    for layer in range(2):
        entry = entries[f"decoder.layers.{layer}.mlp.router.expert_bias"]
        with safe_open(str(folder / entry["shards"]["0"]["file"]), framework="pt") as handle:
            bias = handle.get_tensor(f"decoder.layers.{layer}.mlp.router.expert_bias")
        assert bias.shape == (4,) and bias.abs().sum() > 0  # updated during the 3 steps, not the initial zeros
