"""Llama (2, 3, 3.1, 3.2) and Mistral: RMSNorm, SwiGLU, rope, grouped-query attention, no biases.

HF keeps q/k/v and gate/up as separate linears; ours are fused (``linear_qkv`` per key/value group
``[q of its heads; k; v]``, ``linear_fc1`` ``[gate; up]`` with partition stride 2). HF's rope is the same
"rotate half" as ours, so q and k rows need no permutation. The dense tables here serve qwen2 and qwen3 too.
"""
from __future__ import annotations

from types import MappingProxyType

from megatron_core.models.hf.base import GATE_UP, QKV, Adapter, Rule, expand_rules, refuse

TOP = (Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), partition_dim=0),
       Rule("decoder.final_layernorm.weight", ("model.norm.weight",)))
OUTPUT = Rule("output_layer.weight", ("lm_head.weight",), partition_dim=0)
LAYER = (
    Rule("input_layernorm.weight", ("input_layernorm.weight",)),
    Rule("self_attention.linear_qkv.weight",
         ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), QKV, partition_dim=0),
    Rule("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), partition_dim=1),
    Rule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",)),
    Rule("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), GATE_UP, partition_dim=0,
         stride=2),
    Rule("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), partition_dim=1),
)
QKV_BIAS = (Rule("self_attention.linear_qkv.bias",
                 ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), QKV, partition_dim=0),)
QK_NORM = (Rule("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",)),
           Rule("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",)))
REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
ROPE_TYPES = ("default", "linear", "llama3")


def dense_rules(flags: dict) -> list[Rule]:
    """The tensor map of a llama-shaped model: qkv bias and qk-norm as the flags say."""
    layer = [*LAYER, *(QKV_BIAS if flags.get("add_qkv_bias") else ()), *(QK_NORM if flags.get("qk_layernorm") else ())]
    top = [*TOP, *((OUTPUT,) if flags.get("untie_embeddings_and_output_weights") else ())]
    return expand_rules(top, layer, flags["num_layers"], hf_prefix="model.layers.{i}.")


def rope_flags(config: dict, path: str) -> dict:
    """Our rope flags from ``rope_parameters`` (transformers 5) or ``rope_scaling`` + ``rope_theta`` (4.x)."""
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    params = config.get(key) or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise refuse(path, key, params, "one rope setting for every layer is converted (a dict of rope_type, "
                     "rope_theta, factor ...)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise refuse(path, "partial_rotary_factor", partial, "these families rotate every channel of a head")
    flags = {"position_embedding_type": "rope", "rotary_base": float(theta), "rotary_percent": 1.0,
             "rotary_seq_len_interpolation_factor": None, "use_rope_scaling": False}
    if rope_type == "linear":
        flags["rotary_seq_len_interpolation_factor"] = float(params["factor"])
    elif rope_type == "llama3":
        flags.update(use_rope_scaling=True, rope_scaling_factor=float(params["factor"]),
                     rope_scaling_low_freq_factor=float(params["low_freq_factor"]),
                     rope_scaling_high_freq_factor=float(params["high_freq_factor"]),
                     rope_scaling_original_max_position_embeddings=int(params.get(
                         "original_max_position_embeddings", config.get("max_position_embeddings"))))
    elif rope_type != "default":
        raise refuse(path, f"{key}.rope_type", rope_type, f"supported rope types: {', '.join(ROPE_TYPES)}")
    return flags


def yarn_flags(params: dict) -> dict:
    """Our YaRN flags from a ``rope_parameters`` dict of rope type "yarn" (DeepSeek-V3, gpt-oss)."""
    return {"rope_type": "yarn", "rotary_scaling_factor": float(params["factor"]),
            "mscale": float(params.get("mscale") or 1.0), "mscale_all_dim": float(params.get("mscale_all_dim") or 0.0),
            "yarn_original_max_position_embeddings": int(params.get("original_max_position_embeddings", 4096)),
            "yarn_beta_fast": float(params.get("beta_fast") or 32.0),
            "yarn_beta_slow": float(params.get("beta_slow") or 1.0),
            "yarn_correction_range_round_to_int": bool(params.get("truncate", True))}


def yarn_rope_parameters(flags: dict, *, with_mscale: bool) -> dict:
    """The ``rope_parameters`` entries of the run flags' YaRN (``with_mscale``: also mscale / mscale_all_dim)."""
    rope = {"rope_type": "yarn", "factor": flags.get("rotary_scaling_factor", 1.0),
            "original_max_position_embeddings": flags.get("yarn_original_max_position_embeddings") or 4096,
            "beta_fast": flags.get("yarn_beta_fast") or 32.0, "beta_slow": flags.get("yarn_beta_slow") or 1.0,
            "truncate": flags.get("yarn_correction_range_round_to_int", True) is not False}
    if with_mscale:
        rope.update(mscale=flags.get("mscale", 1.0), mscale_all_dim=flags.get("mscale_all_dim", 0.0))
    return rope


def dense_flags(config: dict, path: str, *, qkv_bias: bool = False, qk_norm: bool = False) -> dict:
    """Run flags of a llama-shaped config.json (the family-specific refusals are the callers')."""
    if config.get("hidden_act", "silu") != "silu":
        raise refuse(path, "hidden_act", config.get("hidden_act"), "the MLP is SwiGLU (silu)")
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    groups = config.get("num_key_value_heads") or heads
    positions = config.get("max_position_embeddings") or 4096
    return {"num_layers": config["num_hidden_layers"], "hidden_size": hidden, "num_attention_heads": heads,
            "group_query_attention": groups != heads, "num_query_groups": groups if groups != heads else None,
            "kv_channels": config.get("head_dim") or hidden // heads, "ffn_hidden_size": config["intermediate_size"],
            "seq_length": min(positions, 4096), "max_position_embeddings": positions,
            "normalization": "RMSNorm", "layernorm_epsilon": config.get("rms_norm_eps", 1e-6), "swiglu": True,
            "openai_gelu": False, "disable_bias_linear": True, "add_qkv_bias": qkv_bias, "qk_layernorm": qk_norm,
            "apply_layernorm_1p": False, "hidden_dropout": 0.0,
            "attention_dropout": config.get("attention_dropout", 0.0),
            "init_method_std": config.get("initializer_range", 0.02),
            "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
            **rope_flags(config, path)}


def refuse_biases(config: dict, path: str, keys: tuple[str, ...]) -> None:
    for key in keys:
        if config.get(key):
            raise refuse(path, key, config[key], "biases on these linears are not mapped (only Qwen2's qkv bias)")


def check_exportable(flags: dict, model_type: str, *, qkv_bias: bool = False, qk_norm: bool = False) -> None:
    wanted = {"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
              "disable_bias_linear": True, "add_qkv_bias": qkv_bias, "qk_layernorm": qk_norm, "rotary_percent": 1.0,
              "apply_layernorm_1p": False, "squared_relu": False, "rotary_interleaved": False}
    for key, value in wanted.items():
        if (flags.get(key) or False) != (value or False) and not (key == "rotary_percent" and key not in flags):
            raise ValueError(f"run flag {key}={flags.get(key)!r} cannot be exported as Hugging Face {model_type!r} "
                             f"(it needs {value!r})")
    if flags.get("num_experts"):
        raise ValueError(f"a mixture-of-experts model cannot be exported as Hugging Face {model_type!r}")


def dense_hf_config(flags: dict, vocab: int, *, model_type: str, architecture: str) -> dict:
    """config.json of the llama-shaped model the run flags describe."""
    heads = flags["num_attention_heads"]
    groups = (flags.get("num_query_groups") if flags.get("group_query_attention") else None) or heads
    rope = {"rope_type": "default", "rope_theta": float(flags.get("rotary_base", 10000.0))}
    if flags.get("use_rope_scaling"):
        rope.update(rope_type="llama3", factor=flags.get("rope_scaling_factor", 8.0),
                    low_freq_factor=flags.get("rope_scaling_low_freq_factor", 1.0),
                    high_freq_factor=flags.get("rope_scaling_high_freq_factor", 4.0),
                    original_max_position_embeddings=flags.get("rope_scaling_original_max_position_embeddings", 8192))
    elif flags.get("rotary_seq_len_interpolation_factor"):
        rope.update(rope_type="linear", factor=flags["rotary_seq_len_interpolation_factor"])
    return {"architectures": [architecture], "model_type": model_type, "vocab_size": vocab,
            "hidden_size": flags["hidden_size"],
            "intermediate_size": flags.get("ffn_hidden_size") or 4 * flags["hidden_size"],
            "num_hidden_layers": flags["num_layers"], "num_attention_heads": heads, "num_key_value_heads": groups,
            "head_dim": flags.get("kv_channels") or flags["hidden_size"] // heads, "hidden_act": "silu",
            "max_position_embeddings": flags.get("max_position_embeddings") or flags.get("seq_length"),
            "rms_norm_eps": flags.get("layernorm_epsilon", 1e-5), "rope_parameters": rope,
            "tie_word_embeddings": not flags.get("untie_embeddings_and_output_weights", False),
            "attention_dropout": flags.get("attention_dropout", 0.0),
            "initializer_range": flags.get("init_method_std", 0.02), "use_cache": True}


def _llama_flags(config: dict, path: str) -> dict:
    refuse_biases(config, path, ("attention_bias", "mlp_bias"))
    return dense_flags(config, path)


def window_flags(config: dict, path: str) -> dict:
    """Mistral's ``sliding_window: W`` on every layer (a token sees itself and the W - 1 before it): our
    ``--window-size W-1,0``; None when absent."""
    window = config.get("sliding_window")
    if window is None:
        return {"window_size": None, "window_attn_skip_freq": None}
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise refuse(path, "sliding_window", window, "it must be a positive number of tokens or null")
    return {"window_size": [window - 1, 0], "window_attn_skip_freq": None}


def _mistral_flags(config: dict, path: str) -> dict:
    return {**dense_flags(config, path), **window_flags(config, path)}


def _llama_config(flags: dict, vocab: int) -> dict:
    check_exportable(flags, "llama")
    return {**dense_hf_config(flags, vocab, model_type="llama", architecture="LlamaForCausalLM"),
            "attention_bias": False, "mlp_bias": False}


def hf_sliding_window(flags: dict, model_type: str):
    """config.json's ``sliding_window`` of the run flags: W for ``--window-size W-1,0`` on every layer."""
    window = flags.get("window_size")
    if not window:
        return None
    if flags.get("window_attn_skip_freq") is not None or window[1] != 0:
        raise ValueError(f"run flags window_size={window}, window_attn_skip_freq={flags.get('window_attn_skip_freq')} "
                         f"cannot be exported as Hugging Face {model_type!r} (one window on every layer)")
    return window[0] + 1


def _mistral_config(flags: dict, vocab: int) -> dict:
    check_exportable(flags, "mistral")
    return {**dense_hf_config(flags, vocab, model_type="mistral", architecture="MistralForCausalLM"),
            "sliding_window": hf_sliding_window(flags, "mistral")}


ADAPTERS = MappingProxyType({
    "llama": Adapter(model_type="llama", architecture="LlamaForCausalLM", required=REQUIRED,
                     flags_from_hf=_llama_flags, hf_config_from_flags=_llama_config, rules=dense_rules),
    "mistral": Adapter(model_type="mistral", architecture="MistralForCausalLM", required=REQUIRED,
                       flags_from_hf=_mistral_flags, hf_config_from_flags=_mistral_config, rules=dense_rules),
})
