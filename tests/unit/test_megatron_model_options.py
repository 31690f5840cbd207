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


def test_rotary_interleaved_is_rotate_half_on_permuted_channels():
    """--rotary-interleaved pairs channels (2i, 2i+1): it equals the rotate-half rope applied to the channels
    reordered evens-then-odds, and reordered back; a model with it differs from one without."""
    torch.manual_seed(0)
    x = torch.randn(6, 2, 3, 8)
    positions = torch.arange(6).unsqueeze(0).expand(2, 6)
    interleaved = apply_rotary_pos_emb(x, RotaryEmbedding(8, interleaved=True)(positions), interleaved=True)
    order = torch.cat([torch.arange(0, 8, 2), torch.arange(1, 8, 2)])
    half = apply_rotary_pos_emb(x[..., order], RotaryEmbedding(8)(positions))
    torch.testing.assert_close(interleaved, half[..., torch.argsort(order)], rtol=0, atol=1e-6)
    assert not torch.allclose(interleaved, apply_rotary_pos_emb(x, RotaryEmbedding(8)(positions)))
    rope = dict(position_embedding_type="rope")
    loss, _ = _loss_and_grads(tiny_config(**rope))
    loss_interleaved, _ = _loss_and_grads(tiny_config(**rope, rotary_interleaved=True))
    assert loss != loss_interleaved  # (near-uniform attention at init: they differ in the fifth digit)


def test_squared_relu_is_relu_squared_in_every_mlp():
    from megatron_core.transformer.mlp import MLP
    config = tiny_config(activation="squared_relu")
    torch.manual_seed(0)
    mlp = MLP(config, layer_number=1, parallel_state=initialize_model_parallel())
    x = torch.randn(4, 2, config.hidden_size)
    out, bias = mlp(x)
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    expected = torch.relu(x @ fc1.weight.t() + fc1.bias).square() @ fc2.weight.t()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bias, fc2.bias)
    from megatron_core.training.arguments import parse_args, transformer_config
    assert transformer_config(parse_args(["--squared-relu"])).activation == "squared_relu"
