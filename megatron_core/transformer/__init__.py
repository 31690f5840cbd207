"""Transformer building blocks: attention, MLP, norms, layers, the per-stage block, and layer specs."""
from megatron_core.transformer.attention import DotProductAttention, SelfAttention
from megatron_core.transformer.block import TransformerBlock
from megatron_core.transformer.inference_cache import InferenceCache
from megatron_core.transformer.layer import TransformerLayer
from megatron_core.transformer.mlp import MLP
from megatron_core.transformer.norms import LayerNorm, Norm, RMSNorm
from megatron_core.transformer.rope import RotaryEmbedding, apply_rotary_pos_emb
from megatron_core.transformer.spec import TransformerLayerSpec, gpt_layer_spec

__all__ = ["DotProductAttention", "SelfAttention", "TransformerBlock", "InferenceCache", "TransformerLayer", "MLP",
           "LayerNorm", "RMSNorm", "Norm", "RotaryEmbedding", "apply_rotary_pos_emb", "TransformerLayerSpec",
           "gpt_layer_spec"]
