"""Mixture of experts: router, token dispatchers over the expert-parallel group, local experts, the MoE layer."""
from megatron_core.transformer.moe.config import MoEConfig
from megatron_core.transformer.moe.moe_layer import MoELayer, check_moe_layout, moe_layer_spec, moe_or_dense_mlp
from megatron_core.transformer.moe.router import TopKRouter

__all__ = ["MoEConfig", "MoELayer", "TopKRouter", "check_moe_layout", "moe_layer_spec", "moe_or_dense_mlp"]
