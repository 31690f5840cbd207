"""gpt-oss's layers against transformers' own modules (fp32): attention with learnable sinks, full and
sliding-window (``GptOssAttention``, eager); the clamped quick GeGLU experts (``GptOssExperts``) and the whole
MoE block (``GptOssMLP``); the off-by-one softmax by hand; windowed tiles of the block kernels against a
dense mask; dropout's backward drawing the forward's masks; incremental decoding of a window + sink model;
the sink parameter's tp attributes and meta-device recipe."""
import dataclasses
import math

import pytest
import torch
from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import (
    GptOssAttention,
    GptOssExperts,
    GptOssMLP,
    GptOssRotaryEmbedding,
)

from megatron_core import initialize_model_parallel
from megatron_core.config import TransformerConfig
from megatron_core.context_parallel.band import Band
from megatron_core.context_parallel.blocks import block_backward, block_forward
from megatron_core.models.hf.base import Dims, _fuse_qkv
from megatron_core.tensor_parallel.initialization import init_flat_values
from megatron_core.transformer import DotProductAttention, InferenceCache, RotaryEmbedding, SelfAttention
from megatron_core.transformer.mlp import mlp_activation
from megatron_core.transformer.moe import MoEConfig, MoELayer
from tests.model_helpers import VOCAB, build_model, tiny_config

HIDDEN, HEADS, GROUPS, HEAD_DIM, SEQ, BATCH = 32, 4, 2, 8, 8, 2
TOL = dict(rtol=1e-5, atol=1e-5)


def _hf_config(sliding_window=None, **overrides) -> GptOssConfig:
    values = dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=HEAD_DIM,
                  num_hidden_layers=2, sliding_window=sliding_window, intermediate_size=6, num_local_experts=4,
                  num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attention_bias=True,
                  attention_dropout=0.0)
    config = GptOssConfig(**{**values, **overrides})
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # GptOssExperts' own loop
    return config


def _our_config(window=None, **overrides) -> TransformerConfig:
    values = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
                  kv_channels=HEAD_DIM, ffn_hidden_size=6, add_qkv_bias=True, add_bias_linear=True,
                  position_embedding_type="rope", softmax_type="learnable", window_size=window,
                  window_attn_skip_freq=2 if window else None, hidden_dropout=0.0, attention_dropout=0.0)
    return TransformerConfig(**{**values, **overrides})


def _hf_mask(seq: int, sliding_window) -> torch.Tensor:
    """Additive ``[1, 1, s, s]``: causal, and with ``sliding_window`` W keys ``> i - W`` (transformers'
    ``sliding_window_overlay``)."""
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    allowed = j <= i
    if sliding_window is not None:
        allowed &= j > i - sliding_window
    return torch.zeros(seq, seq).masked_fill(~allowed, float("-inf"))[None, None]


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_attention_with_sinks_matches_transformers(sliding_window):
    torch.manual_seed(0)
    hf = GptOssAttention(_hf_config(sliding_window), layer_idx=0)
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0.0, 0.3)
        hf.sinks.normal_(0.0, 2.0)  # large enough to take a visible share of each row
    window = None if sliding_window is None else (sliding_window - 1, 0)  # transformers' W is our left W - 1
    ours = SelfAttention(_our_config(window), layer_number=1, parallel_state=initialize_model_parallel())
    dims = Dims(heads=HEADS, groups=GROUPS, kv_channels=HEAD_DIM)
    with torch.no_grad():
        ours.linear_qkv.weight.copy_(_fuse_qkv([hf.q_proj.weight, hf.k_proj.weight, hf.v_proj.weight], dims))
        ours.linear_qkv.bias.copy_(_fuse_qkv([hf.q_proj.bias, hf.k_proj.bias, hf.v_proj.bias], dims))
        ours.linear_proj.weight.copy_(hf.o_proj.weight)
        ours.linear_proj.bias.copy_(hf.o_proj.bias)
        ours.core_attention.softmax_offset.copy_(hf.sinks)
    assert ours.core_attention.window == window

    x = torch.randn(BATCH, SEQ, HIDDEN)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    x_hf, x_ours = x.clone().requires_grad_(), x.transpose(0, 1).clone().requires_grad_()
    expected, _ = hf(x_hf, GptOssRotaryEmbedding(hf.config)(x_hf, positions), _hf_mask(SEQ, sliding_window))
    out, bias = ours(x_ours, None, RotaryEmbedding(HEAD_DIM)(positions))
    out = (out + bias).transpose(0, 1)
    torch.testing.assert_close(out, expected, **TOL)
    dout = torch.randn_like(out)
    (expected * dout).sum().backward()
    (out * dout).sum().backward()
    torch.testing.assert_close(x_ours.grad.transpose(0, 1), x_hf.grad, **TOL)
    torch.testing.assert_close(ours.core_attention.softmax_offset.grad, hf.sinks.grad, **TOL)
    assert hf.sinks.grad.abs().min() > 1e-3  # the sinks take part


def _experts_from_hf(layer_experts, hf: GptOssExperts) -> None:
    """transformers' interleaved ``gate_up_proj [E, h, 2f]`` (gate at even columns) -> our stacked
    ``linear_fc1 [2f, h]`` rows ``[gate; up]``, biases alike; ``down_proj [E, f, h]`` -> ``linear_fc2 [h, f]``."""
    with torch.no_grad():
        for e, expert in enumerate(layer_experts.local_experts.values()):
            gate_up, bias = hf.gate_up_proj[e], hf.gate_up_proj_bias[e]
            expert.linear_fc1.weight.copy_(torch.cat([gate_up[:, ::2], gate_up[:, 1::2]], dim=1).t())
            expert.linear_fc1.bias.copy_(torch.cat([bias[::2], bias[1::2]]))
            expert.linear_fc2.weight.copy_(hf.down_proj[e].t())
            expert.linear_fc2.bias.copy_(hf.down_proj_bias[e])


def _moe_config(grouped: bool, clamp=7.0) -> TransformerConfig:
    return _our_config(activation="quick_geglu", glu_linear_offset=1.0, activation_func_clamp_value=clamp,
                       moe=MoEConfig(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=6,
                                     moe_aux_loss_coeff=0.0, moe_grouped_gemm=grouped))


def _randomize_experts(hf: GptOssExperts) -> GptOssExperts:
    """Projections large enough that both clamps act, outputs O(1)."""
    with torch.no_grad():
        hf.gate_up_proj.normal_(0.0, 1.0)
        hf.gate_up_proj_bias.normal_(0.0, 1.0)
        hf.down_proj.normal_(0.0, 0.05)
        hf.down_proj_bias.normal_(0.0, 0.05)
    return hf


@pytest.mark.parametrize("grouped", [False, True])
def test_clamped_quick_geglu_experts_match_transformers(grouped):
    torch.manual_seed(1)
    hf = _randomize_experts(GptOssExperts(_hf_config()))
    layer = MoELayer(_moe_config(grouped), layer_number=1, parallel_state=initialize_model_parallel())
    _experts_from_hf(layer.experts, hf)
    counts = [3, 0, 4, 2]
    tokens = torch.randn(sum(counts), HIDDEN) * 2
    expert_of = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    gate_up = torch.einsum("nh,nhf->nf", tokens, hf.gate_up_proj[expert_of]) + hf.gate_up_proj_bias[expert_of]
    assert gate_up[:, ::2].max() > 7 and gate_up[:, 1::2].abs().max() > 7  # both clamps act
    expected = hf(tokens, expert_of[:, None], torch.ones(len(tokens), 1))
    tokens_ours = tokens.clone().requires_grad_()
    out = layer.experts(tokens_ours, counts)
    torch.testing.assert_close(out, expected, **TOL)
    out.sum().backward()  # clamped entries pass no grad; the rest flows
    assert tokens_ours.grad.abs().sum() > 0
    unclamped = MoELayer(_moe_config(grouped, clamp=None), layer_number=1, parallel_state=initialize_model_parallel())
    _experts_from_hf(unclamped.experts, hf)
    assert not torch.allclose(unclamped.experts(tokens, counts), expected, **TOL)


def test_moe_block_matches_gpt_oss_mlp():
    """Router (with its bias; top-k of the logits, then softmax over the k) and experts together."""
    torch.manual_seed(2)
    hf = GptOssMLP(_hf_config())
    _randomize_experts(hf.experts)
    with torch.no_grad():
        hf.router.weight.normal_(0.0, 1.0)
        hf.router.bias.normal_(0.0, 1.0)
    layer = MoELayer(_moe_config(grouped=False), layer_number=1, parallel_state=initialize_model_parallel())
    _experts_from_hf(layer.experts, hf.experts)
    with torch.no_grad():
        layer.router.weight.copy_(hf.router.weight)
        layer.router.bias.copy_(hf.router.bias)
    x = torch.randn(BATCH, SEQ, HIDDEN)
    expected, _ = hf(x)
    out, bias = layer(x.transpose(0, 1).contiguous())
    out = out if bias is None else out + bias
    torch.testing.assert_close(out.transpose(0, 1), expected, **TOL)


def test_swiglu_and_quick_geglu_with_clamp_and_offset():
    x = torch.randn(5, 12) * 6
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(mlp_activation(x, "swiglu"), torch.nn.functional.silu(gate) * up)  # unchanged
    g, u = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    torch.testing.assert_close(mlp_activation(x, "swiglu", clamp_value=7.0, linear_offset=1.0),
                               torch.nn.functional.silu(g) * (u + 1.0))
    torch.testing.assert_close(mlp_activation(x, "quick_geglu", clamp_value=7.0, linear_offset=1.0),
                               g * torch.sigmoid(1.702 * g) * (u + 1.0))


def _hand_attention(q, k, v, *, sink_logit, left=None):
    """Per head, from the definition: ``p_j = exp(s_j) / (exp(sink) + sum_k exp(s_k))`` over visible keys.
    q ``[s, b, h, d]``, k, v ``[s, b, g, d]`` -> ``[s, b, h * d]``."""
    s, b, h, d = q.shape
    k, v = k.repeat_interleave(h // k.shape[2], 2), v.repeat_interleave(h // v.shape[2], 2)
    out = torch.zeros(s, b, h, d)
    for i in range(s):
        visible = [j for j in range(i + 1) if left is None or j >= i - left]
        scores = torch.einsum("bhd,jbhd->bhj", q[i], k[visible]) / math.sqrt(d)
        weights = scores.exp() / (math.exp(sink_logit) + scores.exp().sum(-1, keepdim=True))
        out[i] = torch.einsum("bhj,jbhd->bhd", weights, v[visible])
    return out.reshape(s, b, h * d)


@pytest.mark.parametrize("window", [None, (2, 0)])
def test_off_by_one_softmax_by_hand(window):
    config = _our_config(window, softmax_type="off-by-one")
    attention = DotProductAttention(config, layer_number=1, parallel_state=initialize_model_parallel())
    assert attention.softmax_offset is None and list(attention.parameters()) == []
    q, k, v = torch.randn(SEQ, BATCH, HEADS, HEAD_DIM), *torch.randn(2, SEQ, BATCH, GROUPS, HEAD_DIM)
    expected = _hand_attention(q, k, v, sink_logit=0.0, left=None if window is None else window[0])
    torch.testing.assert_close(attention(q, k, v), expected, **TOL)
    vanilla = DotProductAttention(_our_config(window, softmax_type="vanilla"), layer_number=1,
                                  parallel_state=initialize_model_parallel())
    assert not torch.allclose(vanilla(q, k, v), expected, **TOL)


@pytest.mark.parametrize("left", [0, 3, 17])
def test_windowed_tiles_match_a_dense_mask(left):
    """Many small tiles (tile_elements 64), GQA, a causal offset: the band's skipped columns change nothing."""
    g = torch.Generator().manual_seed(3)
    sq, sk, offset = 24, 40, 16
    q, dout = torch.randn(2, 4, sq, 8, generator=g), torch.randn(2, 4, sq, 8, generator=g)
    k, v = torch.randn(2, 2, sk, 8, generator=g), torch.randn(2, 2, sk, 8, generator=g)
    q_pos, k_pos = torch.arange(offset, offset + sq), torch.arange(sk)
    band = Band.of(q_pos, k_pos, (left, 0), q.device)
    dense = (k_pos[None] > q_pos[:, None]) | (k_pos[None] < q_pos[:, None] - left)
    options = dict(scale=0.3, causal=True, causal_offset=offset)
    out, lse = block_forward(q, k, v, band=band, tile_elements=64, **options)
    ref_out, ref_lse = block_forward(q, k, v, mask=dense, tile_elements=1 << 20, **options)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    delta = (dout * out).sum(-1)
    grads = block_backward(q, k, v, dout, delta=delta, lse=lse, band=band, tile_elements=64, out=out, **options)
    ref = block_backward(q, k, v, dout, delta=delta, lse=lse, mask=dense, **options)
    for grad, expected in zip(grads, ref):
        torch.testing.assert_close(grad, expected, **TOL)


def test_dropout_backward_draws_the_forward_masks():
    """fp64, window + learnable sink, dropout 0.3: the same tracker state gives the same output, and the
    directional derivative of backward equals central finite differences of the forward."""
    from megatron_core.tensor_parallel import model_parallel_seed
    state = initialize_model_parallel()
    tracker = model_parallel_seed(5, tp_rank=0, tracker=state.rng_tracker)
    snapshot = tracker.get_states()
    config = _our_config((2, 0), attention_dropout=0.3, params_dtype=torch.float64)
    attention = DotProductAttention(config, layer_number=1, parallel_state=state).train()
    g = torch.Generator().manual_seed(4)
    shapes = [(SEQ, 1, HEADS, HEAD_DIM), (SEQ, 1, GROUPS, HEAD_DIM), (SEQ, 1, GROUPS, HEAD_DIM), (HEADS,)]
    inputs = [torch.randn(shape, generator=g, dtype=torch.float64) for shape in shapes]
    weight = torch.randn(SEQ, 1, HEADS * HEAD_DIM, generator=g, dtype=torch.float64)
    directions = [torch.randn(shape, generator=g, dtype=torch.float64) for shape in shapes]

    def total(tensors):
        tracker.set_states(snapshot)
        with torch.no_grad():
            attention.softmax_offset.copy_(tensors[3])
        return (attention(*tensors[:3]) * weight).sum()

    leaves = [x.clone().requires_grad_() for x in inputs[:3]]
    total(leaves + [inputs[3]]).backward()
    analytic = sum((x.grad * d).sum() for x, d in zip(leaves + [attention.softmax_offset], directions))
    eps = 1e-6
    plus = total([x + eps * d for x, d in zip(inputs, directions)])
    minus = total([x - eps * d for x, d in zip(inputs, directions)])
    torch.testing.assert_close(analytic, (plus - minus) / (2 * eps), rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(total(inputs), total(inputs), rtol=0, atol=0)  # one state, one set of masks
    no_dropout = dataclasses.replace(config, attention_dropout=0.0)
    plain = DotProductAttention(no_dropout, layer_number=1, parallel_state=state)
    with torch.no_grad():
        plain.softmax_offset.copy_(inputs[3])
    assert not torch.allclose((plain(*inputs[:3]) * weight).sum(), total(inputs))  # dropout acts


def test_window_sink_model_decodes_like_its_full_forward():
    state = initialize_model_parallel()
    config = tiny_config(num_layers=4, num_query_groups=2, position_embedding_type="rope", normalization="RMSNorm",
                         window_size=(2, 0), window_attn_skip_freq=2, softmax_type="learnable",
                         activation="quick_geglu", glu_linear_offset=1.0, activation_func_clamp_value=7.0,
                         add_qkv_bias=True)
    model = build_model(config, state).eval()
    windows = [layer.self_attention.core_attention.window for layer in model.decoder.layers]
    assert windows == [(2, 0), None, (2, 0), None]
    with torch.no_grad():
        for layer in model.decoder.layers:
            layer.self_attention.core_attention.softmax_offset.normal_(0.0, 2.0)
    tokens = torch.randint(0, VOCAB, (2, 8))
    positions = torch.arange(8).unsqueeze(0).expand(2, 8)
    with torch.no_grad():
        full = model(tokens, positions)
        cache = InferenceCache(max_sequence_length=8, batch_size=2)
        steps = [model(tokens[:, :3], None, inference_cache=cache)]
        steps += [model(tokens[:, i:i + 1], None, inference_cache=cache) for i in range(3, 6)]
        steps.append(model(tokens[:, 6:], None, inference_cache=cache))  # two new tokens after a cache
        torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-5)
        no_window = build_model(dataclasses.replace(config, window_size=None, window_attn_skip_freq=None), state)
        no_window.load_state_dict(model.state_dict())
        assert not torch.allclose(no_window.eval()(tokens, positions), full, atol=1e-4)  # the window matters


def test_cache_mask_holds_the_window_and_other_caches_are_refused():
    cache = InferenceCache(max_sequence_length=8, batch_size=1, offset=5)
    mask = cache.attention_mask(2, torch.device("cpu"), window=(2, 0))[0, 0]
    visible = [[int(j) for j in (~row).nonzero()] for row in mask]
    assert visible == [[3, 4, 5], [4, 5, 6]]  # positions 5 and 6 see themselves and the 2 before

    class NoWindowCache(InferenceCache):
        def attention_mask(self, s_new, device):
            return super().attention_mask(s_new, device)

    state = initialize_model_parallel()
    model = build_model(tiny_config(window_size=(2, 0)), state).eval()
    with torch.no_grad(), pytest.raises(ValueError, match="sliding window .* takes no window"):
        model(torch.zeros(1, 2, dtype=torch.long), None, inference_cache=NoWindowCache(8, 1))


def test_sink_parameter_is_tp_split_and_builds_on_meta():
    state = initialize_model_parallel()
    meta = dataclasses.replace(state, device=torch.device("meta"), tp_size=2, tp_rank=1)
    attention = DotProductAttention(_our_config(tensor_model_parallel_size=2), layer_number=1, parallel_state=meta)
    param = attention.softmax_offset
    assert param.is_meta and param.shape == (HEADS // 2,)
    assert param.tensor_model_parallel and param.partition_dim == 0 and param.partition_stride == 1
    assert not getattr(param, "sequence_parallel", False)  # each tp rank's heads see every token
    torch.testing.assert_close(init_flat_values(param, 0, HEADS // 2), torch.zeros(HEADS // 2))
    real = DotProductAttention(_our_config(), layer_number=2, parallel_state=state)
    assert real.window is None and torch.equal(real.softmax_offset.detach(), torch.zeros(HEADS))
