"""Self-attention (MHA, GQA, RoPE) against a straightforward per-head reference written from the definitions."""
import math

import pytest
import torch

from megatron_core import initialize_model_parallel
from megatron_core.config import TransformerConfig
from megatron_core.transformer import RotaryEmbedding, SelfAttention


def _rotate(x, positions, base):
    """RoPE from the definition: channel pairs (i, i + d/2) rotated by position * base^(-2i/d)."""
    d = x.shape[-1]
    out = x.clone()
    for i in range(d // 2):
        angle = positions.float() * base ** (-2.0 * i / d)  # [s]
        cos, sin = angle.cos()[:, None], angle.sin()[:, None]
        out[..., i] = x[..., i] * cos[:, 0] - x[..., i + d // 2] * sin[:, 0]
        out[..., i + d // 2] = x[..., i + d // 2] * cos[:, 0] + x[..., i] * sin[:, 0]
    return out


def _reference_attention(x, w_qkv, b_qkv, w_proj, b_proj, *, heads, groups, rope_base):
    """x [s, h] (one sequence); QKV rows laid out per group as [q heads of the group, k, v]."""
    s, d = x.shape[0], w_proj.shape[1] // heads
    per_group = heads // groups
    qkv = (x @ w_qkv.T + b_qkv).view(s, groups, per_group + 2, d)
    positions = torch.arange(s)
    outputs = []
    for head in range(heads):
        group = head // per_group
        q, k, v = qkv[:, group, head % per_group], qkv[:, group, per_group], qkv[:, group, per_group + 1]
        if rope_base is not None:
            q, k = _rotate(q, positions, rope_base), _rotate(k, positions, rope_base)
        scores = q @ k.T / math.sqrt(d)
        scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf"))
        outputs.append(torch.softmax(scores, -1) @ v)
    return torch.cat(outputs, -1) @ w_proj.T + b_proj


@pytest.mark.parametrize("heads, groups, rope", [(4, 4, False), (4, 2, True), (6, 1, True), (4, 4, True)])
def test_self_attention_matches_reference(heads, groups, rope):
    config = TransformerConfig(num_layers=1, hidden_size=24, num_attention_heads=heads, num_query_groups=groups,
                               kv_channels=6, position_embedding_type="rope" if rope else "learned_absolute",
                               max_position_embeddings=8, attention_dropout=0.0, hidden_dropout=0.0)
    torch.manual_seed(0)
    attention = SelfAttention(config, layer_number=1, parallel_state=initialize_model_parallel())
    with torch.no_grad():
        attention.linear_qkv.bias.normal_()
        attention.linear_proj.bias.normal_()
    s, b = 7, 2
    x = torch.randn(s, b, 24)
    rotary = RotaryEmbedding(6, rotary_base=10000.0)(torch.arange(s).expand(b, s)) if rope else None
    out, bias = attention(x, None, rotary)
    out = out + bias
    for batch in range(b):
        expected = _reference_attention(
            x[:, batch], attention.linear_qkv.weight.detach(), attention.linear_qkv.bias.detach(),
            attention.linear_proj.weight.detach(), attention.linear_proj.bias.detach(),
            heads=heads, groups=groups, rope_base=10000.0 if rope else None)
        torch.testing.assert_close(out[:, batch].detach(), expected, rtol=1e-5, atol=1e-5)
