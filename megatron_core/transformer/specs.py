"""``layer_spec_for(config)``: the layer spec a config describes, so every builder (training, generation, the
planner) builds the same model: multi-latent attention with ``config.multi_latent_attention``, MoE MLPs with
``config.moe``, else Megatron's GPT layer."""
from __future__ import annotations

import dataclasses

from megatron_core.config import TransformerConfig
from megatron_core.transformer.spec import TransformerLayerSpec, gpt_layer_spec


def layer_spec_for(config: TransformerConfig) -> TransformerLayerSpec:
    spec = gpt_layer_spec()
    if config.multi_latent_attention:
        from megatron_core.transformer.mla import MLASelfAttention
        spec = dataclasses.replace(spec, self_attention=MLASelfAttention)
    if config.moe is not None:
        from megatron_core.transformer.moe.moe_layer import moe_layer_spec
        spec = moe_layer_spec(spec)
    return spec


__all__ = ["layer_spec_for"]
