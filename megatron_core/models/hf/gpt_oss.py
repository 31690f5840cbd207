"""gpt-oss (OpenAI's gpt-oss-20b / 120b): grouped-query attention with biases and a learned sink logit per
head, sliding-window and full attention alternating by ``layer_types``, YaRN rope, and MoE layers whose
experts run a clamped GeGLU with biases, routed by a softmax over the top-k logits of a gate with a bias.

Our flags: ``--softmax-type learnable`` (``self_attn.sinks`` is ``core_attention.softmax_offset``),
``--window-size W-1,0`` with ``--window-attn-skip-freq`` the 0/1 list of ``layer_types`` (transformers'
``sliding_window: W`` lets a token see itself and the W - 1 before it), ``--quick-geglu --glu-linear-offset
1.0 --activation-func-clamp-value swiglu_limit`` (``(up + 1) * gate * sigmoid(1.702 gate)`` after clamping),
biases everywhere (``add_bias_linear``), the router's included.

Experts: transformers holds them stacked, ``experts.gate_up_proj`` ``[E, h, 2f]`` with gate and up in
alternate columns, ``gate_up_proj_bias`` ``[E, 2f]``, ``down_proj`` ``[E, f, h]``, ``down_proj_bias``
``[E, h]``: each of our experts reads its slice, transposed and de-interleaved into ``[gate; up]``, and an
export stacks them back. The hub's MXFP4-quantized experts (``*_blocks`` / ``*_scales``, config.json's
``quantization_config.quant_method: mxfp4``) are dequantized on import by ``dequantize.py`` into these same
``gate_up_proj`` / ``down_proj`` (bf16, or ``--params-dtype``), one expert at a time; exports are unquantized.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Collection

from megatron_core.models.hf.base import INTERLEAVED_GATE_UP, QKV, TRANSPOSE, Adapter, Rule, refuse
from megatron_core.models.hf.llama import OUTPUT, TOP, dense_flags, dense_hf_config, yarn_flags, yarn_rope_parameters
from megatron_core.models.hf.llama import QKV_BIAS as _QKV_BIAS

REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
            "num_local_experts", "num_experts_per_tok")
QUICK_GELU_ALPHA = 1.702
LAYER = (
    Rule("input_layernorm.weight", ("input_layernorm.weight",)),
    Rule("self_attention.linear_qkv.weight",
         ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), QKV, partition_dim=0),
    *_QKV_BIAS,
    Rule("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), partition_dim=1),
    Rule("self_attention.linear_proj.bias", ("self_attn.o_proj.bias",)),
    Rule("self_attention.core_attention.softmax_offset", ("self_attn.sinks",), partition_dim=0),
    Rule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",)),
    Rule("mlp.router.weight", ("mlp.router.weight",)),
    Rule("mlp.router.bias", ("mlp.router.bias",)),
)


def _expert_rules(experts: int) -> list[Rule]:
    rules = []
    for e in range(experts):
        ours = f"mlp.experts.local_experts.{e}."
        rules += [Rule(f"{ours}linear_fc1.weight", ("mlp.experts.gate_up_proj",), INTERLEAVED_GATE_UP, hf_index=e),
                  Rule(f"{ours}linear_fc1.bias", ("mlp.experts.gate_up_proj_bias",), INTERLEAVED_GATE_UP, hf_index=e),
                  Rule(f"{ours}linear_fc2.weight", ("mlp.experts.down_proj",), TRANSPOSE, hf_index=e),
                  Rule(f"{ours}linear_fc2.bias", ("mlp.experts.down_proj_bias",), hf_index=e)]
    return rules


def _window_pattern(config: dict, path: str) -> list[int]:
    layers = config["num_hidden_layers"]
    types = config.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                          for i in range(layers)]
    if len(types) != layers or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise refuse(path, "layer_types", types, f"one of sliding_attention / full_attention per layer ({layers})")
    return [int(t == "sliding_attention") for t in types]


def _flags(config: dict, path: str) -> dict:
    if config.get("swiglu_alpha", QUICK_GELU_ALPHA) != QUICK_GELU_ALPHA:
        raise refuse(path, "swiglu_alpha", config["swiglu_alpha"], f"the quick GeGLU multiplies by {QUICK_GELU_ALPHA}")
    if not config.get("attention_bias", True):
        raise refuse(path, "attention_bias", False, "gpt-oss's attention has biases")
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    flags = dense_flags({**config, "rope_parameters": {"rope_type": "default",
                                                       "rope_theta": params.get("rope_theta", 150000.0)}}, path)
    if params.get("rope_type", "default") == "yarn":
        flags.update(yarn_flags(params))
    elif params.get("rope_type", "default") != "default":
        raise refuse(path, "rope_parameters.rope_type", params.get("rope_type"), "gpt-oss uses yarn (or default)")
    window = config.get("sliding_window")
    pattern = _window_pattern(config, path)
    flags.update(disable_bias_linear=False, add_qkv_bias=True, swiglu=False, quick_geglu=True, glu_linear_offset=1.0,
                 activation_func_clamp_value=float(config.get("swiglu_limit", 7.0)), softmax_type="learnable",
                 window_size=[int(window) - 1, 0] if window and any(pattern) else None,
                 window_attn_skip_freq=pattern if window and any(pattern) else None)
    flags.update(num_experts=config["num_local_experts"], moe_router_topk=config["num_experts_per_tok"],
                 moe_ffn_hidden_size=config["intermediate_size"], moe_layer_freq=1, moe_router_pre_softmax=False,
                 moe_router_score_function="softmax", moe_router_enable_expert_bias=False,
                 moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=float(config.get(
                     "router_aux_loss_coef", 0.0)), moe_shared_expert_intermediate_size=None,
                 moe_expert_capacity_factor=None, moe_pad_expert_input_to_capacity=False, moe_router_dtype="fp32")
    return flags


def _rules(flags: dict, names: Collection[str] = ()) -> list[Rule]:
    """Every tensor of the model (one layout on disk: ``names``, the folder's, are not needed)."""
    rules = [*TOP, *((OUTPUT,) if flags.get("untie_embeddings_and_output_weights") else ())]
    layer = [*LAYER, *_expert_rules(flags["num_experts"])]
    return rules + [rule.at_layer(i, "decoder.layers.{i}.", "model.layers.{i}.") for i in range(flags["num_layers"])
                    for rule in layer]


def _config(flags: dict, vocab: int) -> dict:
    wanted = {"quick_geglu": True, "softmax_type": "learnable", "disable_bias_linear": False,
              "normalization": "RMSNorm", "glu_linear_offset": 1.0}
    for key, value in wanted.items():
        if flags.get(key) != value:
            raise ValueError(f"run flag {key}={flags.get(key)!r} cannot be exported as Hugging Face 'gpt_oss' "
                             f"(it needs {value!r})")
    if not flags.get("num_experts") or flags.get("moe_layer_freq", 1) != 1:
        raise ValueError("Hugging Face 'gpt_oss' has an MoE MLP in every layer (--num-experts, --moe-layer-freq 1)")
    config = dense_hf_config({**flags, "ffn_hidden_size": flags.get("moe_ffn_hidden_size")}, vocab,
                             model_type="gpt_oss", architecture="GptOssForCausalLM")
    layers, window = flags["num_layers"], flags.get("window_size")
    pattern = [0] * layers
    if window:
        from megatron_core.config_variants import ArchitectureVariants
        probe = ArchitectureVariants(window_size=window, window_attn_skip_freq=flags.get("window_attn_skip_freq"))
        pattern = [int(probe.window_for(i + 1) is not None) for i in range(layers)]
    rope = config["rope_parameters"]
    if (flags.get("rope_type") or "rope") == "yarn":
        rope.update(yarn_rope_parameters(flags, with_mscale=False))
    return {**config, "attention_bias": True, "num_local_experts": flags["num_experts"],
            "num_experts_per_tok": flags.get("moe_router_topk", 2), "sliding_window": window[0] + 1 if window else None,
            "layer_types": ["sliding_attention" if p else "full_attention" for p in pattern],
            "swiglu_limit": flags.get("activation_func_clamp_value") or 7.0, "swiglu_alpha": QUICK_GELU_ALPHA,
            "router_aux_loss_coef": flags.get("moe_aux_loss_coeff", 0.0), "output_router_logits": False}


ADAPTERS = MappingProxyType({"gpt_oss": Adapter(model_type="gpt_oss", architecture="GptOssForCausalLM",
                                                required=REQUIRED, flags_from_hf=_flags, hf_config_from_flags=_config,
                                                rules=_rules, file_rules=_rules)})
