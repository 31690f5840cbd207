"""The planner's per-rank memory (model states + peak activations) is within 10% of what one training step
measures on gloo ranks: ``memory_report`` for the model states, the peak of the bytes autograd holds for
backward (``SavedActivationTracker``) for the activations. Tiny bf16 GPT, CPU dropout masks (2 bytes)."""
import pytest
import torch

from megatron_core.config import TransformerConfig
from megatron_core.planning.measure import measure_layout
from megatron_core.planning.planner import (
    Hardware,
    Layout,
    Workload,
    layout_config,
    model_state_bytes,
    rank_activation_bytes,
    rank_plans,
    rank_transient_bytes,
)

S, B, V, M = 64, 2, 200, 4
MODEL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, hidden_dropout=0.1, attention_dropout=0.1)

LAYOUTS = [  # tp, pp, dp, vpp, zero stage, sequence parallel, recompute
    Layout(1, 1, 1, None, 0, False, None),
    Layout(2, 1, 1, None, 0, False, None),
    Layout(2, 1, 1, None, 0, True, None),
    Layout(2, 1, 1, None, 0, False, "selective"),
    Layout(2, 1, 1, None, 0, True, "selective"),
    Layout(1, 2, 1, None, 0, False, None),
    Layout(1, 2, 1, 2, 0, False, None),
    Layout(1, 4, 1, None, 0, False, None),
    Layout(1, 1, 2, None, 1, False, None),
    Layout(1, 1, 2, None, 3, False, None),
    Layout(2, 2, 1, None, 0, True, None),
    Layout(1, 2, 2, None, 2, False, None),
    Layout(1, 1, 1, None, 0, False, None, 2),      # cp 2 (p2p ring)
    Layout(1, 1, 2, None, 1, False, None, 2),      # cp 2 x dp 2, ZeRO-1 over dp x cp
    Layout(2, 1, 1, None, 0, True, None, 2),       # cp 2 x tp 2 with SP
    Layout(1, 2, 1, None, 0, False, None, 2),      # cp 2 x pp 2
]


def _measure(layout: Layout, model: dict, steps: int = 1, track_live: bool = False, grad_bytes: int = 4):
    return measure_layout(model, tp=layout.tp, pp=layout.pp, zero_stage=layout.zero_stage, vocab_size=V,
                          seq_length=S, micro_batch_size=B, num_microbatches=M, vpp=layout.vpp, steps=steps,
                          track_live=track_live, cp=layout.cp, ep=layout.ep, etp=layout.etp,
                          grad_reduce_in_fp32=grad_bytes == 4)


def predicted_and_measured(distributed, layout: Layout, model: dict = MODEL,
                           grad_bytes: int = 4) -> list[tuple[float, float]]:
    """(predicted, measured) bytes per rank (``grad_bytes`` 2: grads kept and reduced in bf16)."""
    base = TransformerConfig(**model, max_position_embeddings=S, params_dtype=torch.bfloat16, bf16=True)
    config = layout_config(base, layout)
    workload = Workload(vocab_size=V, seq_length=S, micro_batch_size=B, global_batch_size=B * M * layout.dp,
                        make_vocab_size_divisible_by=8, mask_bytes=2, grad_bytes=grad_bytes)
    kwargs = {**model, "sequence_parallel": layout.sequence_parallel, "recompute_granularity": layout.recompute,
              "pipeline_model_parallel_layout": config.pipeline_model_parallel_layout}
    results = distributed(layout.tp * layout.pp * layout.dp * layout.cp, _measure, layout, kwargs, 1, False,
                          grad_bytes)
    pairs = []
    for result in results:
        predicted = (model_state_bytes(config, workload, pp_rank=result.pp_rank, dp=layout.dp_cp,
                                       zero_stage=layout.zero_stage, ep=layout.ep, etp=layout.etp)
                     + rank_activation_bytes(config, workload, pp_rank=result.pp_rank, num_microbatches=M,
                                             ep=layout.ep, etp=layout.etp))
        pairs.append((predicted, result.model_state_bytes + result.activation_bytes))
    return pairs


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_predicted_memory_within_ten_percent(distributed, layout):
    for predicted, measured in predicted_and_measured(distributed, layout):
        assert abs(predicted / measured - 1) < 0.10, (layout, predicted, measured)


@pytest.mark.parametrize("layout, grad_bytes", [(Layout(1, 1, 2, None, 1, False, None), 2),
                                                (Layout(1, 1, 2, None, 2, False, None), 2),
                                                (Layout(1, 4, 1, None, 0, False, None, embedding_loss_split=True), 4)],
                         ids=["zero1-bf16-grads", "zero2-bf16-grads", "pp4-embedding-loss-split"])
def test_predicted_memory_within_ten_percent_with_bf16_grads_or_the_embedding_and_loss_in_the_split(
        distributed, layout, grad_bytes):
    """``--grad-reduce-in-bf16`` (the grad buffers in bf16) and 6 layers over pp 4 with the embedding and loss
    counted as layers (chunks of 1, 2, 2, 1 layers), measured against the prediction."""
    model = {**MODEL, "num_layers": 6} if layout.embedding_loss_split else MODEL
    pairs = predicted_and_measured(distributed, layout, model, grad_bytes)
    for predicted, measured in pairs:
        assert abs(predicted / measured - 1) < 0.10, (layout, predicted, measured)
    if layout.embedding_loss_split:
        assert len({round(measured) for _, measured in pairs}) > 1  # the stages differ


def _moe_model(**options) -> dict:
    from megatron_core.transformer.moe import MoEConfig
    moe = MoEConfig(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, **options)
    return {**MODEL, "moe": moe}


A2A = {"moe_token_dispatcher_type": "alltoall"}
MOE_CASES = [  # layout (ep last), MoE options
    (Layout(1, 1, 1, None, 0, False, None), A2A),
    (Layout(1, 1, 2, None, 1, False, None, 1, 2), A2A),                     # ep 2, ZeRO-1 (experts: expert-dp 1)
    (Layout(1, 1, 2, None, 3, False, None, 1, 2), {}),                      # ep 2, ZeRO-3, allgather dispatcher
    (Layout(1, 1, 2, None, 2, False, None, 1, 1), {**A2A, "moe_grouped_gemm": True}),  # expert-dp 2
    (Layout(2, 1, 1, None, 0, True, None, 1, 2), {**A2A, "moe_shared_expert_intermediate_size": 64}),  # tp2 SP
    (Layout(2, 1, 1, None, 0, True, None, 1, 1, 2), A2A),                   # etp 2 (= tp 2)
    (Layout(2, 1, 2, None, 1, True, None, 1, 2, 2), {}),                    # ep 2 x etp 2, allgather
]


@pytest.mark.parametrize("layout, options", MOE_CASES, ids=lambda v: str(v))
def test_predicted_moe_memory_within_ten_percent(distributed, layout, options):
    """MoE: experts over ep (states over expert-dp), the router, dispatch and expert activations."""
    for predicted, measured in predicted_and_measured(distributed, layout, _moe_model(**options)):
        assert abs(predicted / measured - 1) < 0.10, (layout, predicted, measured)


ZERO_LAYOUTS = [(Layout(1, 1, 2, None, 2, False, None), False), (Layout(1, 1, 2, None, 3, False, None), False),
                (Layout(2, 1, 2, None, 3, True, None), False), (Layout(1, 2, 2, None, 3, False, None), False),
                (Layout(1, 1, 2, None, 3, False, None, 1, 2), True), (Layout(1, 1, 2, None, 3, False, None), True),
                (Layout(2, 1, 2, None, 3, True, None, 1, 1, 2), True)]


@pytest.mark.parametrize("layout, moe", ZERO_LAYOUTS, ids=str)
def test_predicted_zero_transients_match_the_measured_peaks(distributed, layout, moe):
    """The planner's ZeRO rows count what a real step holds transiently: gathered parameters (stage 3) and
    full-size gradient buckets (stages 2-3), against the live-storage counter's peaks. ``moe``: the MoE model at the
    layout's ep (its local experts are one ZeRO-3 unit, gathered over expert-dp)."""
    model = _moe_model(**A2A) if moe else MODEL
    base = TransformerConfig(**model, max_position_embeddings=S, params_dtype=torch.bfloat16, bf16=True)
    config = layout_config(base, layout)
    workload = Workload(vocab_size=V, seq_length=S, micro_batch_size=B, global_batch_size=B * M * layout.dp,
                        make_vocab_size_divisible_by=8, mask_bytes=2)
    kwargs = {**model, "sequence_parallel": layout.sequence_parallel}
    for result in distributed(layout.tp * layout.pp * layout.dp * layout.cp, _measure, layout, kwargs, 1, True):
        predicted = rank_transient_bytes(config, workload, pp_rank=result.pp_rank, zero_stage=layout.zero_stage,
                                         ep=layout.ep, etp=layout.etp)
        assert result.transient_bytes > 0
        assert 0.9 < result.transient_bytes / predicted <= 1.0, (layout, result.transient_bytes, predicted)


def test_ranking_prefers_fitting_layouts_and_validates_inputs():
    base = TransformerConfig(num_layers=8, hidden_size=256, num_attention_heads=8, max_position_embeddings=256,
                             params_dtype=torch.bfloat16, bf16=True)
    workload = Workload(vocab_size=1000, seq_length=256, micro_batch_size=2, global_batch_size=32)
    plans = rank_plans(base, workload, Hardware(num_devices=8, memory_per_device_gb=0.05, peak_tflops=100.0))
    fits = [plan.fits for plan in plans]
    assert fits == sorted(fits, reverse=True) and any(fits) and not all(fits)
    assert {(p.layout.tp * p.layout.pp * p.layout.cp * p.layout.dp) for p in plans} == {8}
    assert {p.layout.cp for p in plans} == {1, 2, 4, 8}  # 256 tokens divide by 2 cp for every cp
    with pytest.raises(ValueError, match="global batch 33"):
        rank_plans(base, Workload(vocab_size=1000, seq_length=256, micro_batch_size=2, global_batch_size=33),
                   Hardware(num_devices=8, memory_per_device_gb=80, peak_tflops=100.0))


def _deepseek_model() -> dict:
    """Multi-latent attention (q_lora_rank, YaRN), MoE layers after a dense one, one MTP depth."""
    from megatron_core.transformer.moe import MoEConfig
    moe = MoEConfig(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_layer_freq=[0, 1, 1, 1],
                    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_shared_expert_intermediate_size=32, moe_ffn_hidden_size=32, **A2A)
    return {**MODEL, "moe": moe, "multi_latent_attention": True, "q_lora_rank": 24, "kv_lora_rank": 16,
            "qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 16, "qk_layernorm": True,
            "position_embedding_type": "rope", "mtp_num_layers": 1}


@pytest.mark.parametrize("layout", [Layout(1, 1, 1, None, 0, False, None), Layout(2, 1, 1, None, 0, True, None),
                                    Layout(1, 2, 1, None, 0, False, None), Layout(1, 1, 2, None, 1, False, None, 1, 2)],
                         ids=str)
def test_predicted_mla_moe_mtp_memory_within_ten_percent(distributed, layout):
    """DeepSeek-V3's shape: the latent projections, the MTP depth on the last stage, MoE with a shared expert."""
    for predicted, measured in predicted_and_measured(distributed, layout, _deepseek_model()):
        assert abs(predicted / measured - 1) < 0.10, (layout, predicted, measured)
