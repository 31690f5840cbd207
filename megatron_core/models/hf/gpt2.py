"""GPT-2: learned absolute positions, LayerNorm (eps ``layer_norm_epsilon``), biases everywhere, the tanh GeLU
(``gelu_new``; our ``openai_gelu``) and tied embeddings. HF stores linear weights as Conv1D ``[in, out]``
(ours are ``[out, in]``) and its fused ``c_attn`` as ``[q of all heads; k; v]``, while our ``linear_qkv`` rows
are per head ``[q_h; k_h; v_h]`` (see ``transformer/attention.py``)."""
from __future__ import annotations

from types import MappingProxyType

from megatron_core.models.hf.base import CONV1D, COPY, GPT2_QKV, Adapter, Rule, expand_rules, refuse

TOP = (Rule("embedding.word_embeddings.weight", ("transformer.wte.weight",), partition_dim=0),
       Rule("embedding.position_embeddings.weight", ("transformer.wpe.weight",)),
       Rule("decoder.final_layernorm.weight", ("transformer.ln_f.weight",)),
       Rule("decoder.final_layernorm.bias", ("transformer.ln_f.bias",)))
OUTPUT = Rule("output_layer.weight", ("lm_head.weight",), partition_dim=0)
LAYER = (
    Rule("input_layernorm.weight", ("ln_1.weight",)), Rule("input_layernorm.bias", ("ln_1.bias",)),
    Rule("self_attention.linear_qkv.weight", ("attn.c_attn.weight",), GPT2_QKV, partition_dim=0),
    Rule("self_attention.linear_qkv.bias", ("attn.c_attn.bias",), GPT2_QKV, partition_dim=0),
    Rule("self_attention.linear_proj.weight", ("attn.c_proj.weight",), CONV1D, partition_dim=1),
    Rule("self_attention.linear_proj.bias", ("attn.c_proj.bias",)),
    Rule("pre_mlp_layernorm.weight", ("ln_2.weight",)), Rule("pre_mlp_layernorm.bias", ("ln_2.bias",)),
    Rule("mlp.linear_fc1.weight", ("mlp.c_fc.weight",), CONV1D, partition_dim=0),
    Rule("mlp.linear_fc1.bias", ("mlp.c_fc.bias",), COPY, partition_dim=0),
    Rule("mlp.linear_fc2.weight", ("mlp.c_proj.weight",), CONV1D, partition_dim=1),
    Rule("mlp.linear_fc2.bias", ("mlp.c_proj.bias",)),
)
REQUIRED = ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions")
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def rules(flags: dict) -> list[Rule]:
    top = [*TOP, *((OUTPUT,) if flags.get("untie_embeddings_and_output_weights") else ())]
    return expand_rules(top, LAYER, flags["num_layers"], hf_prefix="transformer.h.{i}.")


def flags_from_hf(config: dict, path: str) -> dict:
    if config.get("n_inner") is not None and (isinstance(config["n_inner"], bool) or not isinstance(
            config["n_inner"], int) or config["n_inner"] < 1):
        raise ValueError(f"{path}: n_inner must be a positive integer, got {config['n_inner']!r}")
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if config.get(key):
            raise refuse(path, key, config[key], "GPT-2's plain attention is converted")
    if config.get("scale_attn_weights", True) is False:
        raise refuse(path, "scale_attn_weights", False, "attention scores are always scaled by 1/sqrt(d)")
    activation = config.get("activation_function", "gelu_new")
    if activation not in TANH_GELUS + ("gelu",):
        raise refuse(path, "activation_function", activation, "gelu_new or gelu")
    n_embd, positions = config["n_embd"], config["n_positions"]
    return {"num_layers": config["n_layer"], "hidden_size": n_embd, "num_attention_heads": config["n_head"],
            "ffn_hidden_size": config.get("n_inner") or 4 * n_embd, "seq_length": positions,
            "max_position_embeddings": positions, "layernorm_epsilon": config.get("layer_norm_epsilon", 1e-5),
            "openai_gelu": activation in TANH_GELUS, "hidden_dropout": config.get("resid_pdrop", 0.1),
            "attention_dropout": config.get("attn_pdrop", 0.1),
            "init_method_std": config.get("initializer_range", 0.02),
            "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", True),
            "position_embedding_type": "learned_absolute", "normalization": "LayerNorm", "swiglu": False,
            "disable_bias_linear": False, "group_query_attention": False, "num_query_groups": None,
            "kv_channels": None}


def check_exportable(flags: dict, description: str = "the checkpoint") -> None:
    wanted = {"normalization": "LayerNorm", "position_embedding_type": "learned_absolute", "swiglu": False,
              "disable_bias_linear": False, "group_query_attention": False, "qk_layernorm": False,
              "squared_relu": False, "rotary_interleaved": False}
    for key, value in wanted.items():
        if (flags.get(key) or False) != (value or False) and key in flags:
            raise ValueError(f"{description}: config {key}={flags.get(key)!r} cannot be exported as GPT-2 "
                             f"(needs {value!r})")
    if flags.get("kv_channels") not in (None, flags["hidden_size"] // flags["num_attention_heads"]):
        raise ValueError(f"{description}: kv_channels {flags['kv_channels']} != hidden/heads cannot be GPT-2")


def hf_config_from_flags(flags: dict, vocab: int) -> dict:
    """The config.json of a GPT2LMHeadModel with the architecture the run flags describe."""
    check_exportable(flags)
    positions = flags.get("max_position_embeddings") or flags["seq_length"]
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab,
              "n_positions": positions, "n_embd": flags["hidden_size"], "n_layer": flags["num_layers"],
              "n_head": flags["num_attention_heads"], "n_inner": flags.get("ffn_hidden_size"),
              "activation_function": "gelu_new" if flags.get("openai_gelu") else "gelu",
              "layer_norm_epsilon": flags.get("layernorm_epsilon", 1e-5),
              "resid_pdrop": flags.get("hidden_dropout", 0.0), "embd_pdrop": flags.get("hidden_dropout", 0.0),
              "attn_pdrop": flags.get("attention_dropout", 0.0),
              "initializer_range": flags.get("init_method_std", 0.02),
              "tie_word_embeddings": not flags.get("untie_embeddings_and_output_weights", False)}
    if flags.get("tokenizer_type") in (None, "ByteTokenizer", "NullTokenizer", "GPT2BPETokenizer"):
        config["bos_token_id"] = config["eos_token_id"] = vocab - 1  # their eod is the last id
    return config


def _hf_name(name: str) -> str:
    """GPT2Model saves names without the ``transformer.`` prefix GPT2LMHeadModel uses."""
    return name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}"


ADAPTERS = MappingProxyType({"gpt2": Adapter(model_type="gpt2", architecture="GPT2LMHeadModel", required=REQUIRED,
                                             flags_from_hf=flags_from_hf, hf_config_from_flags=hf_config_from_flags,
                                             rules=rules, hf_name=_hf_name)})
