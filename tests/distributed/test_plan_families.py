"""The planner's per-rank memory within 10% of a real step for the Hugging Face families' layer features
(the zoo's registry): Llama (GQA, SwiGLU, RMSNorm, rope, untied), Qwen2 (QKV bias), Qwen3 (per-head q/k norms),
gpt-oss (learnable softmax sinks, sliding windows, MoE) and Mixtral (MoE SwiGLU experts), at tp 2 with SP and
at pp 2."""
import pytest

from megatron_core.planning.planner import Layout
from megatron_core.transformer.moe import MoEConfig
from tests.distributed.test_planner import MODEL, predicted_and_measured

LLAMA = {**MODEL, "num_query_groups": 2, "activation": "swiglu", "normalization": "RMSNorm",
         "position_embedding_type": "rope", "untie_embeddings_and_output_weights": True, "add_bias_linear": False,
         "ffn_hidden_size": 96}
FAMILIES = {
    "llama": LLAMA,
    "qwen2": {**LLAMA, "add_qkv_bias": True},
    "qwen3": {**LLAMA, "qk_layernorm": True},
    "gpt-oss": {**LLAMA, "add_bias_linear": True, "softmax_type": "learnable", "window_size": (16, 0),
                "moe": MoEConfig(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                                 moe_ffn_hidden_size=48)},
    "mixtral": {**LLAMA, "moe": MoEConfig(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                                          moe_ffn_hidden_size=48)},
}


@pytest.mark.parametrize("layout", [Layout(2, 1, 1, None, 0, True, None), Layout(1, 2, 1, None, 0, False, None)],
                         ids=["tp2-sp", "pp2"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_predicted_memory_of_hf_families_within_ten_percent(distributed, family, layout):
    for predicted, measured in predicted_and_measured(distributed, layout, FAMILIES[family]):
        assert abs(predicted / measured - 1) < 0.10, (family, layout, predicted, measured)
