"""Layer specs: the submodule classes a transformer layer is built from.

A new architecture is a new spec (plus config), not a copy of the model: swap the norm, the attention, the
core attention or the MLP for a subclass of your own, with the same constructor signature:

    norm(config, hidden_size, *, device)                                   -> module: [..., h] -> [..., h]
    self_attention(config, *, layer_number, parallel_state, core_attention) -> (output, bias)
    core_attention(config, *, layer_number, parallel_state)                -> [sq, b, heads/tp * d]
    mlp(config, *, layer_number, parallel_state)                           -> (output, bias)
    layer(config, *, layer_number, parallel_state, spec)                   -> hidden

``gpt_layer_spec()`` is Megatron's GPT (norm chosen by ``config.normalization``); ``llama_layer_spec()`` in
``megatron_core.models.llama`` is a worked example of another architecture built only through a spec.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from torch import nn

from megatron_core.transformer.attention import DotProductAttention, SelfAttention
from megatron_core.transformer.layer import TransformerLayer
from megatron_core.transformer.mlp import MLP
from megatron_core.transformer.norms import Norm


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerLayerSpec:
    """Which class builds each part of a layer (and the block's final norm)."""

    layer: type[nn.Module] = TransformerLayer
    input_norm: Callable[..., nn.Module] = Norm
    self_attention: type[nn.Module] = SelfAttention
    core_attention: type[nn.Module] = DotProductAttention
    pre_mlp_norm: Callable[..., nn.Module] = Norm
    mlp: type[nn.Module] = MLP
    final_norm: Callable[..., nn.Module] = Norm


def gpt_layer_spec() -> TransformerLayerSpec:
    """Megatron's GPT layer: pre-norm (LayerNorm or RMSNorm per config), self-attention, MLP."""
    return TransformerLayerSpec()
