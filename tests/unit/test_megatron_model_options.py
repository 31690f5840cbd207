"""Model options behind Megatron-LM's flags (issue 15): --apply-layernorm-1p, --qk-layernorm, --rotary-percent,
--no-position-embedding, --recompute-modules. Single process, tiny shapes, the plain-torch kernels."""
import pytest
import torch

from megatron_core import initialize_model_parallel
from megatron_core.transformer.attention import SelfAttention
from megatron_core.transformer.rope import RotaryEmbedding, apply_rotary_pos_emb
from tests.model_helpers import build_model, make_batch, tiny_config


def _loss_and_grads(config):
    state = initialize_model_parallel()
    model = build_model(config, state)
    input_ids, positions, labels = make_batch()
    loss = model(input_ids, positions, labels=labels).mean()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_1p_is_the_same_model_with_zero_centered_weights(normalization):
    loss, grads = _loss_and_grads(tiny_config(normalization=normalization))
    loss_1p, grads_1p = _loss_and_grads(tiny_config(normalization=normalization, layernorm_zero_centered_gamma=True))
    torch.testing.assert_close(loss_1p, loss)
    for name, grad in grads.items():  # d/dw of (1 + w) x = d/dw of w x
        torch.testing.assert_close(grads_1p[name], grad, rtol=1e-5, atol=1e-6)
    state = initialize_model_parallel()
    model = build_model(tiny_config(normalization=normalization, layernorm_zero_centered_gamma=True), state)
    assert torch.count_nonzero(model.decoder.layers[0].input_layernorm.weight) == 0


def test_qk_layernorm_normalizes_each_head():
    config = tiny_config(num_layers=1, normalization="RMSNorm", qk_layernorm=True, layernorm_epsilon=1e-12)
    torch.manual_seed(0)
    attention = SelfAttention(config, layer_number=1, parallel_state=initialize_model_parallel())
    assert attention.q_layernorm.weight.shape == (config.kv_channels,)
    x = torch.randn(5, 2, config.hidden_size)
    out, _ = attention(x)
    with torch.no_grad():  # scale q and k of every head: RMS-normalized, the output does not change
        d, heads_per_group = config.kv_channels, config.num_heads_per_group
        rows = attention.linear_qkv.weight.view(config.num_query_groups, heads_per_group + 2, d, -1)
        rows[:, : heads_per_group + 1] *= 3.0
        attention.linear_qkv.bias.view(config.num_query_groups, heads_per_group + 2, d)[:, : heads_per_group + 1] *= 3.0
    scaled, _ = attention(x)
    torch.testing.assert_close(scaled, out, rtol=1e-4, atol=1e-5)


def test_rotary_percent_rotates_only_the_first_channels():
    s, b, heads, d = 6, 2, 3, 8
    x = torch.randn(s, b, heads, d)
    positions = torch.arange(s).expand(b, s)
    partial = apply_rotary_pos_emb(x, RotaryEmbedding(4)(positions))
    torch.testing.assert_close(partial[..., 4:], x[..., 4:], rtol=0, atol=0)
    torch.testing.assert_close(partial[..., :4], apply_rotary_pos_emb(x[..., :4], RotaryEmbedding(4)(positions)))
    config = tiny_config(position_embedding_type="rope", rotary_percent=0.5)
    model = build_model(config, initialize_model_parallel())
    assert model.rotary_pos_emb.inv_freq.numel() == config.kv_channels // 4
    halved = RotaryEmbedding(4, seq_len_interpolation_factor=2.0)(positions)
    torch.testing.assert_close(halved, RotaryEmbedding(4)(positions.float() / 2))


def test_no_position_embedding():
    model = build_model(tiny_config(position_embedding_type="none"), initialize_model_parallel())
    assert model.embedding.position_embeddings is None and model.rotary_pos_emb is None
    loss, _ = _loss_and_grads(tiny_config(position_embedding_type="none"))
    assert torch.isfinite(loss)


@pytest.mark.parametrize("modules", [("mlp",), ("layernorm",), ("core_attn", "mlp", "layernorm")])
def test_selective_recompute_modules_keep_the_gradients(modules):
    loss, grads = _loss_and_grads(tiny_config())
    loss_r, grads_r = _loss_and_grads(tiny_config(recompute_granularity="selective", recompute_modules=modules))
    torch.testing.assert_close(loss_r, loss)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_r[name], grad, rtol=1e-5, atol=1e-7)
