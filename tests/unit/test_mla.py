"""Multi-latent attention: MLASelfAttention against transformers' DeepseekV3Attention (with and without
q_lora_rank, interleaved and rotate-half rope, YaRN with mscale / mscale_all_dim), a GPTModel built through
layer_spec_for decoding incrementally from the latent cache (logits of the full forward, cache bytes per token
measured from the buffers), selective recompute of mla_up_proj / core_attn, meta-device builds and the paged
engine's refusal. fp32, small shapes."""
import dataclasses

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from megatron_core import initialize_model_parallel
from megatron_core.config import TransformerConfig
from megatron_core.tensor_parallel.initialization import init_flat_values
from megatron_core.transformer import InferenceCache
from megatron_core.transformer.mla import MLASelfAttention
from megatron_core.transformer.rope import RotaryEmbedding
from tests.model_helpers import SEQ, VOCAB, build_model, make_batch, tiny_config

HIDDEN, HEADS, KV_RANK, NOPE, ROPE, V_DIM = 32, 4, 16, 8, 4, 6
YARN = dict(factor=4.0, mscale=1.0, mscale_all_dim=0.8, original_max_position_embeddings=16)
HF_TO_OURS = {"q_proj": "linear_q_proj", "q_a_proj": "linear_q_down_proj", "q_a_layernorm": "q_layernorm",
              "q_b_proj": "linear_q_up_proj", "kv_a_proj_with_mqa": "linear_kv_down_proj",
              "kv_a_layernorm": "kv_layernorm", "kv_b_proj": "linear_kv_up_proj", "o_proj": "linear_proj"}

# the tiny GPT of tests.model_helpers (hidden 16, 4 heads, 2 layers) with DeepSeek-style MLA and YaRN
MLA_GPT = dict(multi_latent_attention=True, q_lora_rank=12, kv_lora_rank=8, qk_head_dim=4, qk_pos_emb_head_dim=4,
               v_head_dim=6, normalization="RMSNorm", qk_layernorm=True, position_embedding_type="rope",
               add_bias_linear=False, rotary_interleaved=True, rotary_scaling_factor=2.0, mscale=1.0,
               mscale_all_dim=1.0, yarn_original_max_position_embeddings=4)


def _hf_attention(q_lora_rank, interleave: bool) -> tuple[DeepseekV3Attention, DeepseekV3Config]:
    config = DeepseekV3Config(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=q_lora_rank,
        kv_lora_rank=KV_RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM,
        max_position_embeddings=64, rope_interleave=interleave, attention_bias=False, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, **YARN))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attention = DeepseekV3Attention(config, layer_idx=0).float()
    with torch.no_grad():
        for param in attention.parameters():  # norms away from 1, so a missing or misplaced norm shows
            param.normal_(0.0, 0.2) if param.dim() == 2 else param.uniform_(0.5, 1.5)
    return attention, config


def _our_config(q_lora_rank, interleave: bool) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, multi_latent_attention=True,
        q_lora_rank=q_lora_rank, kv_lora_rank=KV_RANK, qk_head_dim=NOPE, qk_pos_emb_head_dim=ROPE, v_head_dim=V_DIM,
        position_embedding_type="rope", normalization="RMSNorm", qk_layernorm=True, layernorm_epsilon=1e-6,
        add_bias_linear=False, rotary_interleaved=interleave, rotary_scaling_factor=YARN["factor"],
        mscale=YARN["mscale"], mscale_all_dim=YARN["mscale_all_dim"],
        yarn_original_max_position_embeddings=YARN["original_max_position_embeddings"],
        max_position_embeddings=64, attention_dropout=0.0, hidden_dropout=0.0)


@pytest.mark.parametrize("interleave", [True, False], ids=["rope-interleave", "rotate-half"])
@pytest.mark.parametrize("q_lora_rank", [None, 24], ids=["q-direct", "q-lora"])
def test_matches_transformers_deepseek_v3_attention(q_lora_rank, interleave):
    hf, hf_config = _hf_attention(q_lora_rank, interleave)
    config = _our_config(q_lora_rank, interleave)
    ours = MLASelfAttention(config, layer_number=1, parallel_state=initialize_model_parallel())
    # the layouts agree row for row: [latent; k_pe] and per head [k_nope; v] / [q_nope; q_pe]
    state = {f"{HF_TO_OURS[name.split('.')[0]]}.{name.split('.', 1)[1]}": value
             for name, value in hf.state_dict().items()}
    ours.load_state_dict(state, strict=True)
    s, b = 12, 2
    x = torch.randn(b, s, HIDDEN, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(s).expand(b, s)
    causal = torch.full((s, s), float("-inf")).triu(1)[None, None]
    expected, _ = hf(x, DeepseekV3RotaryEmbedding(hf_config)(x, positions), causal)
    rotary = RotaryEmbedding(config.rotary_dim, rotary_base=config.rotary_base, interleaved=interleave,
                             yarn=config.yarn_rope_scaling)(positions)
    out, bias = ours(x.transpose(0, 1), None, rotary)
    assert bias is None and config.rope_attention_factor != 1.0  # YaRN's cos/sin factor is exercised
    diff = (out.transpose(0, 1) - expected).abs().max().item()
    assert diff < 1e-5, diff


def test_parameter_names_and_replication_tags():
    state = initialize_model_parallel()
    config = dataclasses.replace(_our_config(24, True), sequence_parallel=False)
    names = {name: tuple(p.shape) for name, p in MLASelfAttention(config, layer_number=1,
                                                                  parallel_state=state).named_parameters()}
    assert names == {"linear_q_down_proj.weight": (24, HIDDEN), "q_layernorm.weight": (24,),
                     "linear_q_up_proj.weight": (HEADS * (NOPE + ROPE), 24),
                     "linear_kv_down_proj.weight": (KV_RANK + ROPE, HIDDEN), "kv_layernorm.weight": (KV_RANK,),
                     "linear_kv_up_proj.weight": (HEADS * (NOPE + V_DIM), KV_RANK),
                     "linear_proj.weight": (HIDDEN, HEADS * V_DIM)}
    attention = MLASelfAttention(_our_config(None, True), layer_number=1, parallel_state=state)
    assert attention.linear_q_proj.weight.tensor_model_parallel
    down = attention.linear_kv_down_proj.weight
    assert not down.tensor_model_parallel and down.partition_dim == -1 and down.init_recipe.partition_dim == -1


def _mla_gpt(state, **overrides):
    return build_model(tiny_config(**{**MLA_GPT, **overrides}), state)


def test_incremental_decoding_from_the_latent_cache_equals_full_forward():
    state = initialize_model_parallel()
    model = _mla_gpt(state).eval()
    assert type(model.decoder.layers[0].self_attention) is MLASelfAttention  # through layer_spec_for
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    up_projections = []
    with torch.no_grad():
        full = model(tokens, torch.arange(SEQ).expand(2, SEQ))
        for layer in model.decoder.layers:
            layer.self_attention.linear_kv_up_proj.register_forward_pre_hook(lambda *_: up_projections.append(1))
        cache = InferenceCache(max_sequence_length=SEQ, batch_size=2)
        steps = [model(tokens[:, :3], None, inference_cache=cache)]
        steps += [model(tokens[:, i:i + 1], None, inference_cache=cache) for i in range(3, 5)]
        steps.append(model(tokens[:, 5:], None, inference_cache=cache))  # several new tokens after a cache
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-5)
    assert len(up_projections) == 2  # the prompt's, per layer; later steps absorb the up projection
    config = model.config
    assert not cache.key_value and sorted(cache.latents) == [1, 2]  # latents only, no per-head keys / values
    measured = sum(t.numel() * t.element_size() for pair in cache.latents.values() for t in pair) / (SEQ * 2)
    formula = (config.kv_lora_rank + config.qk_pos_emb_head_dim) * config.num_layers * 4  # fp32
    assert measured == cache.bytes_per_token() == formula == 96
    assert cache.latents[1][0].shape == (SEQ, 2, config.kv_lora_rank)
    assert cache.latents[1][1].shape == (SEQ, 2, config.qk_pos_emb_head_dim)


def _loss_grads_and_up_proj_calls(recompute_modules):
    state = initialize_model_parallel()
    recompute = {} if recompute_modules is None else dict(recompute_granularity="selective",
                                                          recompute_modules=recompute_modules)
    model = _mla_gpt(state, **recompute)
    calls = []
    for layer in model.decoder.layers:
        layer.self_attention.linear_kv_up_proj.register_forward_pre_hook(lambda *_: calls.append(1))
    input_ids, positions, labels = make_batch()
    loss = model(input_ids, positions, labels=labels)
    loss.mean().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, len(calls)


@pytest.mark.parametrize("modules, up_proj_runs", [(("mla_up_proj",), 4), (("core_attn", "mla_up_proj"), 4),
                                                   (("core_attn",), 2)])
def test_selective_recompute_gives_identical_grads(modules, up_proj_runs):
    loss, grads, calls = _loss_grads_and_up_proj_calls(None)
    assert calls == 2  # one up projection per layer
    loss_r, grads_r, calls_r = _loss_grads_and_up_proj_calls(modules)
    assert calls_r == up_proj_runs  # run again in backward when recomputed
    assert torch.equal(loss, loss_r)
    for name, grad in grads.items():
        assert torch.equal(grad, grads_r[name]), name


def test_meta_device_build_draws_the_same_weights():
    """ZeRO-3's sharded construction: every parameter of a meta-device build has an init recipe that gives the
    values of the real build."""
    state = initialize_model_parallel()
    real = _mla_gpt(state)
    meta = _mla_gpt(dataclasses.replace(state, device=torch.device("meta")))
    for (name, param), reference in zip(meta.named_parameters(), real.parameters()):
        assert param.is_meta, name
        assert torch.equal(init_flat_values(param, 0, param.numel()).view(param.shape), reference.detach()), name


def test_paged_engine_refuses_mla():
    from megatron_core.inference.engine import InferenceEngine
    state = initialize_model_parallel()
    with pytest.raises(ValueError, match="multi_latent_attention.*static path"):
        InferenceEngine(_mla_gpt(state).eval(), state, num_blocks=4)


def test_cache_needs_causal_mask():
    state = initialize_model_parallel()
    attention = MLASelfAttention(_our_config(None, True), layer_number=1, parallel_state=state)
    x = torch.randn(3, 1, HIDDEN)
    with pytest.raises(ValueError, match="inference cache works with the causal mask"):
        attention(x, torch.zeros(1, 1, 3, 3, dtype=torch.bool), None,
                  inference_cache=InferenceCache(max_sequence_length=4, batch_size=1))
