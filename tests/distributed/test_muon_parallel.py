"""Muon under tp 2 x dp 2 (sequence parallel, ZeRO 1-3, tp modes duplicated and distributed) equals
megatron-core's TensorParallelMuon + torch's AdamW run in one process on the full batch, over several steps."""
import pytest
import torch

from megatron_core import initialize_model_parallel
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.optimizer import OptimizerConfig, get_optimizer
from tests.distributed.test_optimizer_parity import KEY_BIAS_TOLERANCE, _gpt_loss, gpt_parity_diffs, train_gpt_steps
from tests.model_helpers import build_model, tiny_config, unshard
from tests.unit.test_muon import GQA, STEPS, _reference

SETTINGS = dict(lr=1e-2, weight_decay=0.1, momentum=0.8, nesterov=True, scale_mode="spectral", split_qkv=True,
                prec="high")  # fp32 Newton-Schulz: parity is then to fp32 rounding, not to bf16's


def train_gpt_muon(stage: int, tp_mode: str):
    state = initialize_model_parallel(tensor_model_parallel_size=2)
    model = build_model(tiny_config(tensor_model_parallel_size=2, sequence_parallel=True, **GQA), state)
    dims = {n: (p.partition_dim if getattr(p, "tensor_model_parallel", False) else None, p.partition_stride)
            for n, p in model.named_parameters()}
    ddp = DistributedDataParallel(model, config=DistributedDataParallelConfig(zero_stage=stage, bucket_size=700),
                                  dp_group=state.dp_group)
    optimizer = get_optimizer(OptimizerConfig(
        optimizer="muon", lr=SETTINGS["lr"], weight_decay=SETTINGS["weight_decay"], clip_grad=0.0,
        muon_momentum=SETTINGS["momentum"], muon_use_nesterov=True, muon_fp32_matmul_prec="high",
        muon_tp_mode=tp_mode), ddp, parallel_state=state)
    train_gpt_steps(ddp, optimizer, state, STEPS)
    split = sum(piece.is_shard for piece in optimizer.pieces if piece.master in optimizer.optimizer.matrices)
    return {n: (t, *dims[n]) for n, t in ddp.state_dict().items() if n in dims}, split


@pytest.fixture(scope="module")
def reference():
    import tests.unit.test_muon as unit
    unit_loss = unit._loss
    try:  # the reference sees the full 4-row batch of each step, as the dp ranks together
        unit._loss = lambda model, step: _gpt_loss(model, step)
        return _reference(build_model(tiny_config(**GQA), initialize_model_parallel()), **SETTINGS)
    finally:
        unit._loss = unit_loss


@pytest.mark.parametrize("stage,tp_mode", [(0, "duplicated"), (1, "duplicated"), (3, "duplicated"),
                                           (2, "distributed")])
def test_tp2_dp2_muon_matches_megatron_single_process(distributed, reference, stage, tp_mode):
    results = distributed(4, train_gpt_muon, stage, tp_mode)
    tp_pair = [results[0][0], results[1][0]]  # ranks 0, 1: the tp shards of dp rank 0
    full = {n: unshard([r[n][0] for r in tp_pair], tp_pair[0][n][1], tp_pair[0][n][2]) for n in tp_pair[0]}
    diff, key_bias = gpt_parity_diffs(full, {n: reference[n] for n in full}, tiny_config(**GQA))
    print(f"largest |param - reference| stage {stage} {tp_mode}: {diff:.2e}, key-bias rows {key_bias:.2e}")
    assert diff <= 1e-5, f"stage {stage} {tp_mode}: largest parameter difference {diff:.3e}"
    assert key_bias <= KEY_BIAS_TOLERANCE, f"stage {stage} {tp_mode}: largest key-bias difference {key_bias:.3e}"
    if stage >= 1:
        assert all(split > 0 for _, split in results)  # Muon ran on 1/dp slices, through the bucket gathers
    for rank in (2, 3):  # dp rank 1 holds the same values
        assert all(torch.equal(results[rank][0][n][0], results[rank - 2][0][n][0]) for n in full)
