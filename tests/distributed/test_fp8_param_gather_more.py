"""``--fp8-param-gather`` beyond the dense per-tensor linears: the routed experts' fc1 / fc2 weights (loop and
grouped GEMM, per-expert scales) go as 1-byte FP8 in the ZeRO gathers of the expert buckets (over expert-dp),
and under the blockwise recipe every tagged weight goes as FP8 with per-128x128-block scales from per-block
amaxes all-reduced over dp; bit-identical to the run without the flag. The runs and checks are
``test_fp8_parallel``'s (dp 2 gloo ranks, bf16 parameters, Adam, 3 steps and a resume), on its tiny GPT,
with MoE layers (4 experts, top-2, ep 1: expert-dp = dp) or a wider dense MLP (several blocks per weight)."""
import contextlib

import pytest
import torch

from tests.distributed.test_fp8_parallel import (
    _assert_fp8_gather_bytes,
    _assert_same_training,
    _assert_zero3_fp8_gather_bytes,
    _fp8_gather_run,
    _fp8_weights,
)

LAYERS, EXPERTS = 2, 4
DENSE_FP8_WEIGHTS = 2 * LAYERS  # linear_qkv, linear_proj per layer (the MLPs are MoE)
EXPERT_WEIGHTS = 2 * EXPERTS * LAYERS  # fc1, fc2 per expert and layer


def _moe(grouped):
    from megatron_core.transformer.moe import MoEConfig
    return {"moe": MoEConfig(num_moe_experts=EXPERTS, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                             moe_ffn_hidden_size=16, moe_grouped_gemm=grouped)}


def expert_weights(ddp):
    """The routed experts' fc1 / fc2 weights."""
    return {p for name, p in ddp.module.named_parameters() if ".local_experts." in name and name.endswith(".weight")}


def fp8_and_expert_weights(ddp):
    """What goes as FP8 bytes: the FP8 linears' weights and the routed experts'."""
    return _fp8_weights(ddp) | expert_weights(ddp)


CASES = [(1, "tensorwise", False), (2, "delayed", True), (1, "delayed", False), (2, "tensorwise", True)]


@pytest.mark.parametrize("stage,recipe,grouped", CASES)
def test_moe_expert_weights_gathered_as_fp8_bit_identical(distributed, stage, recipe, grouped):
    """ZeRO-1/2 at dp 2 with MoE layers: the gather after the step sends the experts' weights (their buckets,
    over expert-dp) in 1 byte per element with each expert's own scale, the attention's FP8 weights as before:
    bytes = the other parameters' + one per FP8 element, exactly (p2p). Bit-identical to the run without it."""
    plain = distributed(2, _fp8_gather_run, stage, recipe, False, None, 3, _moe(grouped), fp8_and_expert_weights)
    fp8 = distributed(2, _fp8_gather_run, stage, recipe, True, None, 3, _moe(grouped), fp8_and_expert_weights)
    for rank, (ref, mine) in enumerate(zip(plain, fp8)):
        _assert_same_training(rank, ref, mine)
        _assert_fp8_gather_bytes(rank, ref, mine, None, DENSE_FP8_WEIGHTS + EXPERT_WEIGHTS)


@pytest.mark.parametrize("recipe,grouped", [("tensorwise", True), ("delayed", False)])
def test_zero3_moe_expert_weights_gathered_as_fp8_bit_identical(distributed, recipe, grouped):
    """ZeRO-3 at dp 2 with MoE layers: every unit gather of the experts' buckets (``LocalExperts`` is one unit)
    sends their weights in 1 byte per element (delayed: once calibrated), exactly the shards' other bytes plus
    one per FP8 element; one amax all-reduce per FP8 bucket and step. Bit-identical to the run without it."""
    plain = distributed(2, _fp8_gather_run, 3, recipe, False, None, 3, _moe(grouped), fp8_and_expert_weights)
    fp8 = distributed(2, _fp8_gather_run, 3, recipe, True, None, 3, _moe(grouped), fp8_and_expert_weights)
    for rank, (ref, mine) in enumerate(zip(plain, fp8)):
        _assert_same_training(rank, ref, mine)
        _assert_zero3_fp8_gather_bytes(rank, ref, mine, recipe, None, DENSE_FP8_WEIGHTS + EXPERT_WEIGHTS)


def _local_experts(grouped, recipe):
    """Experts 1-3 of 4 (bf16, SwiGLU) with ``fp8_param_gather``; delayed: every scale set (64)."""
    from megatron_core.fp8 import Fp8Config
    from megatron_core.transformer.moe import MoEConfig
    from megatron_core.transformer.moe.experts import LocalExperts
    from tests.model_helpers import tiny_config
    moe = MoEConfig(num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=grouped)
    config = tiny_config(fp8=Fp8Config(fp8_recipe=recipe, fp8_param_gather=True), moe=moe, activation="swiglu",
                         params_dtype=torch.bfloat16, bf16=True)
    experts = LocalExperts(config, expert_ids=range(1, 4), expert_seeds=[11, 12, 13, 14], device="cpu")
    if experts.fp8_state is not None:
        experts.fp8_state.fp8_scale.fill_(64.0)
    return experts


def _gather_by_hand(experts, expert_ids):
    """What the ZeRO gather leaves on the weights of ``expert_ids`` (one rank holding them whole): the values
    quantized with the weight's scale, dequantized in place, and the gather entry."""
    from megatron_core.fp8.param_gather import gather_spec, keep_gathered
    from megatron_core.fp8.quantize import cast_to_fp8
    for expert_id in expert_ids:
        expert = experts.local_experts[str(expert_id)]
        for weight in (expert.linear_fc1.weight, expert.linear_fc2.weight):
            spec, flat = gather_spec(weight), weight.detach().reshape(-1)
            amax = spec.piece_amax(flat, 0)
            scale = spec.scale(amax).float()
            each = spec.piece_scale(scale, 0, flat.numel())
            dequantized = cast_to_fp8(flat.float() * each, spec.fmt).float() * torch.reciprocal(each)
            with torch.no_grad():
                weight.copy_(dequantized.view_as(weight))
            keep_gathered(weight, scale, amax.reshape(spec.blocks), spec)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
@pytest.mark.parametrize("gathered", [[1, 3], [1, 2, 3]])
def test_expert_gemms_quantize_gathered_weights_with_their_scale(grouped, recipe, gathered):
    """The expert GEMMs (loop, grouped) take each gathered expert's scale (and, delayed, record its global amax)
    and quantize the others as without the flag (``[1, 3]``: expert 2 gathered plainly; delayed: its weight
    scales not calibrated, so not gathered in FP8 and passed through): output, input grad, weight grads and the
    recorded amaxes equal the exact weights' without gather entries."""
    ref, mine = _local_experts(grouped, recipe), _local_experts(grouped, recipe)
    if recipe == "delayed" and 2 not in gathered:
        for experts in (ref, mine):
            experts.fp8_state.fp8_scale[2, :, 1] = 0.0
    _gather_by_hand(mine, gathered)
    assert any(not torch.equal(a, b) for a, b in zip(ref.parameters(), mine.parameters()))
    counts = [5, 4, 9]
    tokens, g = torch.randn(18, 16, dtype=torch.bfloat16), torch.randn(18, 16, dtype=torch.bfloat16)
    results, handed = [], []
    for experts in (ref, mine):
        x = tokens.clone().requires_grad_(True)
        with _record_gathered(handed):
            out = experts(x, counts)
        (out.float() * g.float()).sum().backward()
        grads = {n: p.grad for n, p in experts.named_parameters() if n.endswith(".weight")}
        step = experts.fp8_state.fp8_amax_step.clone() if experts.fp8_state is not None else None
        results.append((out.detach(), x.grad, grads, step))
    assert torch.equal(results[1][0], results[0][0]) and torch.equal(results[1][1], results[0][1])
    for name, grad in results[0][2].items():
        assert torch.equal(results[1][2][name], grad), name
    if recipe == "delayed":
        assert torch.equal(results[1][3], results[0][3])
    if grouped:  # the grouped GEMMs (fc1, fc2) got the stacked entries: none without, some or all with them
        assert handed[:2] == [None, None] and [entry.mask is None for entry in handed[2:]] == [len(gathered) == 3] * 2


@contextlib.contextmanager
def _record_gathered(handed):
    """Appends the ``gathered`` each ``fp8_linear`` call of ``LocalExperts`` gets to ``handed``."""
    from megatron_core.transformer.moe import experts as module
    original = module.fp8_linear

    def fp8_linear(*args, gathered=None, **kwargs):
        handed.append(gathered)
        return original(*args, gathered=gathered, **kwargs)
    module.fp8_linear = fp8_linear
    try:
        yield
    finally:
        module.fp8_linear = original


BLOCKWISE_MLP = {"ffn_hidden_size": 160}  # fc1 [320, 16]: 3 x 1 blocks of 128x128, fc2 [16, 160]: 1 x 2


@pytest.mark.parametrize("stage,model,p2p", [(1, "dense", None), (2, "dense", False), (2, "moe", None)])
def test_blockwise_weights_gathered_as_fp8_bit_identical(distributed, stage, model, p2p):
    """Blockwise at ZeRO-1/2, dp 2: the FP8 linears' (and routed experts', grouped GEMM) weights go as 1 byte
    per element, each element with its 128x128 block's scale from the per-block amaxes all-reduced over dp (the
    flat shards cut through blocks); the layer quantizes the gathered weight (forward W, dgrad W^T) with those
    scales. Bit-identical to the run without the flag; p2p: exactly the other bytes plus one per FP8 element."""
    options = BLOCKWISE_MLP if model == "dense" else {"moe": _moe_blocks()}
    weights, n = (_fp8_weights, 8) if model == "dense" else (fp8_and_expert_weights, DENSE_FP8_WEIGHTS + EXPERT_WEIGHTS)
    plain = distributed(2, _fp8_gather_run, stage, "blockwise", False, p2p, 3, options, weights)
    fp8 = distributed(2, _fp8_gather_run, stage, "blockwise", True, p2p, 3, options, weights)
    for rank, (ref, mine) in enumerate(zip(plain, fp8)):
        _assert_same_training(rank, ref, mine)
        _assert_fp8_gather_bytes(rank, ref, mine, p2p, n)


def test_zero3_blockwise_weights_gathered_as_fp8_bit_identical(distributed):
    """Blockwise at ZeRO-3, dp 2, MoE with the loop GEMM: every unit gather sends the FP8 linears' and experts'
    weights in 1 byte per element with per-block scales; bit-identical to the run without the flag."""
    options = {"moe": _moe_blocks(grouped=False)}
    plain = distributed(2, _fp8_gather_run, 3, "blockwise", False, None, 3, options, fp8_and_expert_weights)
    fp8 = distributed(2, _fp8_gather_run, 3, "blockwise", True, None, 3, options, fp8_and_expert_weights)
    for rank, (ref, mine) in enumerate(zip(plain, fp8)):
        _assert_same_training(rank, ref, mine)
        _assert_zero3_fp8_gather_bytes(rank, ref, mine, "blockwise", None, DENSE_FP8_WEIGHTS + EXPERT_WEIGHTS)


def _moe_blocks(grouped=True):
    """Experts of fc1 [160, 16] (2 x 1 blocks) and fc2 [16, 80]."""
    from megatron_core.transformer.moe import MoEConfig
    return MoEConfig(num_moe_experts=EXPERTS, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                     moe_ffn_hidden_size=80, moe_grouped_gemm=grouped)


@pytest.mark.parametrize("shape", [(320, 16), (16, 160), (300, 270), (5, 7)])
def test_blockwise_pieces_give_the_layers_block_scales_and_bytes(shape):
    """A blockwise weight cut into flat pieces (as dp shards cut it, through blocks): the MAX of the pieces'
    per-block amaxes is ``block_amax`` of the whole weight, and each piece quantized with its elements' block
    scales gives ``quantize_blocks``'s bytes of the whole weight."""
    from megatron_core.fp8 import Fp8Config
    from megatron_core.fp8.param_gather import tag_weight
    from megatron_core.fp8.quantize import BLOCKWISE_WEIGHT_BLOCK, block_amax, cast_to_fp8, quantize_blocks
    weight = torch.nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(3)).bfloat16())
    tag_weight(weight, Fp8Config(fp8_recipe="blockwise", fp8_param_gather=True), None)
    spec, flat = weight.fp8_gather_spec, weight.detach().reshape(-1)
    cuts = sorted({0, 7, flat.numel() // 3, flat.numel() // 3 + 129, flat.numel()} & set(range(flat.numel() + 1)))
    pieces = list(zip(cuts, cuts[1:]))
    amax = torch.stack([spec.piece_amax(flat[a:b], a) for a, b in pieces]).amax(0)
    assert torch.equal(amax.reshape(spec.blocks), block_amax(weight.detach(), BLOCKWISE_WEIGHT_BLOCK))
    scale = spec.scale(amax)
    q = torch.cat([cast_to_fp8(flat[a:b].float() * spec.piece_scale(scale, a, b - a), spec.fmt) for a, b in pieces])
    expected = quantize_blocks(weight.detach(), spec.fmt, BLOCKWISE_WEIGHT_BLOCK)
    assert torch.equal(q.view(torch.uint8), expected.data.reshape(-1).view(torch.uint8))
