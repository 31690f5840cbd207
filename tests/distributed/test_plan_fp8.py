"""The planner's memory of FP8 layouts (``planning.fp8``) against real steps on gloo ranks: the per-rank total
within 10% of the measured one, and the bytes FP8 saves (high-precision run minus FP8 run, both measured)
within 10% of the predicted saving, which is the part the total's tolerance could hide. Tiny bf16 GPT as in
test_planner.py; two steps, so that delayed scaling is calibrated in the measured one."""
import dataclasses

import pytest
import torch

from megatron_core.config import TransformerConfig
from megatron_core.fp8 import Fp8Config
from megatron_core.planning.fp8 import fp8_layers_on_stage
from megatron_core.planning.measure import measure_layout
from megatron_core.planning.planner import Layout, Workload, layout_config, model_state_bytes, rank_activation_bytes
from megatron_core.transformer.moe import MoEConfig

S, B, V, M = 64, 2, 200, 4
MODEL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, hidden_dropout=0.1, attention_dropout=0.1)
MOE = MoEConfig(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                moe_shared_expert_intermediate_size=64)

CASES = [  # layout (tp, pp, dp, vpp, zero, sp, recompute, cp, ep), fp8, moe
    (Layout(1, 1, 1, None, 0, False, None), Fp8Config(fp8_recipe="tensorwise"), None),
    (Layout(2, 1, 1, None, 0, True, None), Fp8Config(fp8_recipe="delayed"), None),
    (Layout(1, 2, 1, None, 0, False, None), Fp8Config(fp8_recipe="tensorwise", first_last_layers_bf16=True), None),
    (Layout(1, 1, 2, None, 1, False, None), Fp8Config(fp8_recipe="tensorwise"), MOE),
    (Layout(2, 1, 1, None, 0, True, None), Fp8Config(fp8_recipe="delayed"), MOE),
    (Layout(1, 1, 1, None, 0, False, None), Fp8Config(fp8_recipe="blockwise"), None),  # saves bf16 inputs
]


def _measure(layout: Layout, model: dict):
    return measure_layout(model, tp=layout.tp, pp=layout.pp, zero_stage=layout.zero_stage, vocab_size=V,
                          seq_length=S, micro_batch_size=B, num_microbatches=M, steps=2, ep=layout.ep)


def _predicted(layout: Layout, model: dict, pp_rank: int) -> tuple[float, float]:
    """(model states, activations) the planner predicts for ``pp_rank``."""
    base = TransformerConfig(**model, max_position_embeddings=S, params_dtype=torch.bfloat16, bf16=True)
    config = layout_config(base, layout)
    workload = Workload(vocab_size=V, seq_length=S, micro_batch_size=B, global_batch_size=B * M * layout.dp,
                        make_vocab_size_divisible_by=8, mask_bytes=2)
    states = model_state_bytes(config, workload, pp_rank=pp_rank, dp=layout.dp_cp, zero_stage=layout.zero_stage,
                               ep=layout.ep)
    return states, rank_activation_bytes(config, workload, pp_rank=pp_rank, num_microbatches=M, ep=layout.ep)


def _case_id(case) -> str:
    layout, fp8, moe = case
    return (f"tp{layout.tp}{'sp' if layout.sequence_parallel else ''}-pp{layout.pp}-dp{layout.dp}-{fp8.fp8_recipe}"
            f"{'-firstlast' if fp8.first_last_layers_bf16 else ''}{'-moe' if moe else ''}")


@pytest.mark.parametrize("layout, fp8, moe", CASES, ids=[_case_id(c) for c in CASES])
def test_fp8_memory_and_its_saving_match_measured_steps(distributed, layout, fp8, moe):
    model = {**MODEL, "sequence_parallel": layout.sequence_parallel, **({"moe": moe} if moe else {})}
    world = layout.tp * layout.pp * layout.dp
    high = distributed(world, _measure, layout, model)
    low = distributed(world, _measure, layout, {**model, "fp8": fp8})
    for plain, quantized in zip(high, low):
        states, activations = _predicted(layout, {**model, "fp8": fp8}, quantized.pp_rank)
        _, plain_activations = _predicted(layout, model, quantized.pp_rank)
        measured = quantized.model_state_bytes + quantized.activation_bytes
        assert abs((states + activations) / measured - 1) < 0.10, (layout, states + activations, measured)
        assert quantized.model_state_bytes == plain.model_state_bytes  # no FP8 weight copies are kept
        saving, measured_saving = plain_activations - activations, plain.activation_bytes - quantized.activation_bytes
        if fp8.fp8_recipe == "blockwise":
            assert saving == 0 and abs(measured_saving) < 1024, measured_saving
        else:
            assert abs(saving / measured_saving - 1) < 0.10, (layout, quantized.pp_rank, saving, measured_saving)


def test_fp8_layer_counts_follow_first_last_layers_bf16():
    """Layers 1 and 4 stay in high precision: the outer stages of pp 4 hold no FP8 layer."""
    config = TransformerConfig(**MODEL, max_position_embeddings=S, pipeline_model_parallel_size=4,
                               moe=MoEConfig(num_moe_experts=4, moe_layer_freq=[0, 1, 1, 1]),
                               fp8=Fp8Config(fp8_recipe="tensorwise", first_last_layers_bf16=True))
    assert [fp8_layers_on_stage(config, pp_rank=r) for r in range(4)] == [(0, 0), (0, 1), (0, 1), (0, 0)]
    assert fp8_layers_on_stage(dataclasses.replace(config, fp8=None), pp_rank=1) == (0, 0)
    whole = dataclasses.replace(config, pipeline_model_parallel_size=1, fp8=Fp8Config(fp8_recipe="delayed"))
    assert fp8_layers_on_stage(whole, pp_rank=0) == (1, 3)
