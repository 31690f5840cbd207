"""The MoE layer on tensors without values (meta here; a dry run's fake CUDA tensors): the dispatcher sizes
its permutation, all-to-all splits and expert groups by ``BalancedRouting`` instead of the routing map."""
import pytest
import torch

from megatron_core import initialize_model_parallel
from megatron_core.config import TransformerConfig
from megatron_core.transformer.moe import MoEConfig, MoELayer
from megatron_core.transformer.moe.dispatcher import AllToAllDispatcher, BalancedRouting

S, B, H, E = 6, 2, 8, 4


def test_balanced_routing_counts():
    assert BalancedRouting(topk=2).counts(12, 4) == [6, 6, 6, 6]
    assert BalancedRouting(topk=2).counts(5, 4) == [3, 3, 2, 2]  # 10 assignments, the remainder to the first
    assert BalancedRouting(topk=2, capacity=lambda rows: 2).counts(12, 4) == [2, 2, 2, 2]  # dropped to capacity
    assert BalancedRouting(topk=1, capacity=lambda rows: 5, pad_to_capacity=True).counts(3, 4) == [3] * 4


def test_a_map_without_values_needs_balanced_routing():
    dispatcher = AllToAllDispatcher(num_experts=E, ep_group=None)
    tokens, probs = torch.empty(S, H, device="meta"), torch.empty(S, E, device="meta")
    with pytest.raises(ValueError, match=r"routing map \(6, 4\) holds no values.*BalancedRouting"):
        dispatcher.dispatch(tokens, probs, torch.empty(S, E, dtype=torch.bool, device="meta"))


@pytest.mark.parametrize("options", [
    {}, {"moe_grouped_gemm": True}, {"moe_token_dispatcher_type": "allgather", "moe_grouped_gemm": True},
    {"moe_expert_capacity_factor": 0.5},
    {"moe_expert_capacity_factor": 0.5, "moe_pad_expert_input_to_capacity": True},
], ids=["alltoall", "grouped", "allgather", "capacity-drop", "capacity-pad"])
def test_moe_layer_trains_on_tensors_without_values(options):
    """Before: ``masked_select`` / boolean indexing of the routing map raised on meta (and fake) tensors,
    whose sizes depend on values. Now forward and backward run with balanced routing's shapes."""
    moe = MoEConfig(num_moe_experts=E, moe_router_topk=2, **{"moe_token_dispatcher_type": "alltoall", **options})
    config = TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=2, ffn_hidden_size=12,
                               activation="swiglu", hidden_dropout=0.0, attention_dropout=0.0,
                               max_position_embeddings=S, moe=moe)
    layer = MoELayer(config, layer_number=1, parallel_state=initialize_model_parallel()).to("meta")
    seen = []
    layer.experts.register_forward_pre_hook(lambda module, args: seen.append((args[0].shape[0], list(args[1]))))
    x = torch.empty(S, B, H, device="meta", requires_grad=True)
    out, _ = layer(x)
    out.sum().backward()
    assert out.shape == x.shape and x.grad.shape == x.shape
    balanced = BalancedRouting(topk=2, capacity=moe.capacity, pad_to_capacity=moe.moe_pad_expert_input_to_capacity)
    assert seen == [(sum(balanced.counts(S * B, E)), balanced.counts(S * B, E))]
