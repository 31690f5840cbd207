"""DeepSeek-V3 (and R1, V3.1): multi-latent attention, sigmoid-routed MoE with group limits, a correction
bias and shared experts after ``first_k_dense_replace`` dense layers, and optional multi-token prediction.

Attention (``self_attn.``): ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` (or ``q_proj`` without
``q_lora_rank``) are our ``linear_q_down_proj`` / ``q_layernorm`` / ``linear_q_up_proj`` (``linear_q_proj``),
``kv_a_proj_with_mqa`` ([latent; k_pe]) / ``kv_a_layernorm`` / ``kv_b_proj`` (per head [k_nope; v]) our
``linear_kv_down_proj`` / ``kv_layernorm`` / ``linear_kv_up_proj``, ``o_proj`` our ``linear_proj``: the same
layouts (Megatron's), so every tensor is copied; the down projections are replicated over tp, the up
projections split by heads. ``rope_interleave: true`` (the default) rotates channel pairs (2i, 2i + 1): our
``--rotary-interleaved``.

MoE (``mlp.``): ``gate.weight`` / ``gate.e_score_correction_bias`` are the router's weight and expert bias
(``--moe-router-enable-expert-bias``), ``experts.<e>.{gate,up,down}_proj`` (or transformers 5's fused
``experts.gate_up_proj`` / ``down_proj``) the routed experts, ``shared_experts.*`` the shared expert
(``n_shared_experts x moe_intermediate_size`` wide). transformers scores each group by its top two experts;
Megatron (and we) by the top ``topk / topk_group``: equal for DeepSeek-V3 (8 / 4), refused otherwise.

Multi-token prediction: the hub's folders hold the MTP module as layer ``num_hidden_layers + k``
(``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, a full decoder layer, and copies of the embedding
and head that are shared here); transformers drops it. When present it becomes ``mtp.layers.<k>``
(``--mtp-num-layers``); a folder without it converts without MTP.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Collection

from megatron_core.models.hf.base import GATE_UP, Adapter, Rule, refuse
from megatron_core.models.hf.llama import OUTPUT, TOP, dense_flags, rope_flags, yarn_flags, yarn_rope_parameters
from megatron_core.models.hf.mixtral import DENSE_MLP, moe_layer_pattern

REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
            "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "kv_lora_rank", "qk_rope_head_dim",
            "qk_nope_head_dim", "v_head_dim")
NORMS = (Rule("input_layernorm.weight", ("input_layernorm.weight",)),
         Rule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",)))
KV = (Rule("self_attention.linear_kv_down_proj.weight", ("self_attn.kv_a_proj_with_mqa.weight",)),
      Rule("self_attention.kv_layernorm.weight", ("self_attn.kv_a_layernorm.weight",)),
      Rule("self_attention.linear_kv_up_proj.weight", ("self_attn.kv_b_proj.weight",), partition_dim=0),
      Rule("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), partition_dim=1))
Q_LORA = (Rule("self_attention.linear_q_down_proj.weight", ("self_attn.q_a_proj.weight",)),
          Rule("self_attention.q_layernorm.weight", ("self_attn.q_a_layernorm.weight",)),
          Rule("self_attention.linear_q_up_proj.weight", ("self_attn.q_b_proj.weight",), partition_dim=0))
Q_DIRECT = (Rule("self_attention.linear_q_proj.weight", ("self_attn.q_proj.weight",), partition_dim=0),)
SHARED = (Rule("mlp.shared_experts.linear_fc1.weight", ("mlp.shared_experts.gate_proj.weight",
                                                        "mlp.shared_experts.up_proj.weight"), GATE_UP,
               partition_dim=0, stride=2),
          Rule("mlp.shared_experts.linear_fc2.weight", ("mlp.shared_experts.down_proj.weight",), partition_dim=1))
MTP_HEAD = (Rule("enorm.weight", ("enorm.weight",)), Rule("hnorm.weight", ("hnorm.weight",)),
            Rule("eh_proj.weight", ("eh_proj.weight",)),
            Rule("final_layernorm.weight", ("shared_head.norm.weight",)))
MTP_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def _int(config: dict, key: str, path: str, default=None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise refuse(path, key, value, "it must be a non-negative integer")
    return value


def _rope(config: dict, path: str) -> dict:
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if params.get("rope_type", params.get("type", "default")) != "yarn":
        return {**rope_flags(config, path), "rope_type": "rope"}
    if bool(params.get("mscale")) != bool(params.get("mscale_all_dim")):
        raise refuse(path, "rope_parameters", params, "YaRN with only one of mscale / mscale_all_dim scales rope and "
                     "the softmax differently in transformers; give both or neither")
    base = rope_flags({**config, "rope_parameters": {**params, "rope_type": "default"}}, path)
    return {**base, **yarn_flags(params)}


def _moe_flags(config: dict, path: str, layers: int) -> dict:
    experts, topk = _int(config, "n_routed_experts", path), _int(config, "num_experts_per_tok", path)
    groups, group_topk = _int(config, "n_group", path, 1), _int(config, "topk_group", path, 1)
    if config.get("scoring_func", "sigmoid") != "sigmoid" or config.get("topk_method", "noaux_tc") != "noaux_tc":
        raise refuse(path, "scoring_func/topk_method", (config.get("scoring_func"), config.get("topk_method")),
                     "DeepSeek-V3 routes by sigmoid scores with a correction bias (noaux_tc)")
    if not config.get("norm_topk_prob", True):
        raise refuse(path, "norm_topk_prob", False, "the sigmoid router normalizes the top-k weights (Megatron's)")
    if groups > 1 and topk // max(group_topk, 1) != 2:
        raise refuse(path, "topk_group", group_topk, f"transformers scores each group by its top 2 experts, Megatron "
                     f"by the top num_experts_per_tok / topk_group = {topk // max(group_topk, 1)}")
    dense = _int(config, "first_k_dense_replace", path, 0)
    shared = _int(config, "n_shared_experts", path, 0)
    return {"num_experts": experts, "moe_router_topk": topk, "moe_ffn_hidden_size": config["moe_intermediate_size"],
            "moe_layer_freq": 1 if dense == 0 else [0] * dense + [1] * (layers - dense),
            "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
            "moe_router_pre_softmax": False, "moe_router_num_groups": groups if groups > 1 else None,
            "moe_router_group_topk": group_topk if groups > 1 else None,
            "moe_router_topk_scaling_factor": float(config.get("routed_scaling_factor", 1.0)),
            "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0, "moe_router_dtype": "fp32",
            "moe_shared_expert_intermediate_size": shared * config["moe_intermediate_size"] if shared else None,
            "moe_expert_capacity_factor": None, "moe_pad_expert_input_to_capacity": False}


def _flags(config: dict, path: str) -> dict:
    if config.get("attention_bias"):
        raise refuse(path, "attention_bias", True, "DeepSeek-V3's attention has no biases")
    heads = config["num_attention_heads"]
    if config.get("num_key_value_heads", heads) != heads:
        raise refuse(path, "num_key_value_heads", config["num_key_value_heads"], "multi-latent attention has one "
                     f"key/value head per query head ({heads})")
    flags = dense_flags({**config, "head_dim": config["v_head_dim"], "rope_parameters": None, "rope_scaling": None},
                        path)
    flags.update(_rope(config, path))
    flags.update(multi_latent_attention=True, q_lora_rank=config.get("q_lora_rank"),
                 kv_lora_rank=config["kv_lora_rank"], qk_head_dim=config["qk_nope_head_dim"],
                 qk_pos_emb_head_dim=config["qk_rope_head_dim"], v_head_dim=config["v_head_dim"], qk_layernorm=True,
                 rotary_interleaved=bool(config.get("rope_interleave", True)),
                 mtp_num_layers=None, hf_mtp_layers=_int(config, "num_nextn_predict_layers", path, 0))
    return {**flags, **_moe_flags(config, path, flags["num_layers"])}


def _layer_rules(flags: dict, i: int, is_moe: bool, names: Collection[str], hf: str) -> list[Rule]:
    layer = [*NORMS, *(Q_LORA if flags.get("q_lora_rank") else Q_DIRECT), *KV]
    if not is_moe:
        return layer + list(DENSE_MLP)
    layer += [Rule("mlp.router.weight", ("mlp.gate.weight",)),
              Rule("mlp.router.expert_bias", ("mlp.gate.e_score_correction_bias",))]
    if f"{hf}mlp.experts.gate_up_proj" in names:  # transformers 5's fused layout
        layer += [Rule(f"mlp.experts.local_experts.{e}.linear_fc{n}.weight", (f"mlp.experts.{t}",), hf_index=e)
                  for e in range(flags["num_experts"]) for n, t in ((1, "gate_up_proj"), (2, "down_proj"))]
    else:
        for e in range(flags["num_experts"]):
            ours, theirs = f"mlp.experts.local_experts.{e}.", f"mlp.experts.{e}."
            layer += [Rule(f"{ours}linear_fc1.weight", (f"{theirs}gate_proj.weight", f"{theirs}up_proj.weight"),
                           GATE_UP),
                      Rule(f"{ours}linear_fc2.weight", (f"{theirs}down_proj.weight",))]
    return layer + (list(SHARED) if flags.get("moe_shared_expert_intermediate_size") else [])


def _rules(flags: dict, names: Collection[str] = ()) -> list[Rule]:
    rules = [*TOP, *((OUTPUT,) if flags.get("untie_embeddings_and_output_weights") else ())]
    for i, is_moe in enumerate(moe_layer_pattern(flags)):
        hf = f"model.layers.{i}."
        rules += [rule.at_layer(i, "decoder.layers.{i}.", hf) for rule in _layer_rules(flags, i, is_moe, names, hf)]
    for k in range(flags.get("mtp_num_layers") or 0):
        hf, ours = f"model.layers.{flags['num_layers'] + k}.", f"mtp.layers.{k}."
        rules += [rule.at_layer(k, ours, hf) for rule in MTP_HEAD]
        rules += [rule.at_layer(k, ours + "transformer_layer.", hf)
                  for rule in _layer_rules(flags, k, True, names, hf)]
    return rules


def _file_rules(flags: dict, names: Collection[str]) -> list[Rule]:
    """The rules of the folder: the MTP layers the hub holds (``eh_proj`` present) become ours."""
    present = [k for k in range(flags.get("hf_mtp_layers") or 0)
               if f"model.layers.{flags['num_layers'] + k}.eh_proj.weight" in names]
    flags["mtp_num_layers"] = len(present) or None
    return _rules(flags, names)


def _export_rules(flags: dict) -> list[Rule]:
    """The rules an export writes: the hub's layout, with the MTP layers' copies of the embedding and head
    (what SGLang and vLLM read for speculative decoding)."""
    rules = _rules(flags)
    for k in range(flags.get("mtp_num_layers") or 0):
        hf = f"model.layers.{flags['num_layers'] + k}."
        rules += [Rule("embedding.word_embeddings.weight", (f"{hf}embed_tokens.weight",), partition_dim=0),
                  Rule("output_layer.weight" if flags.get("untie_embeddings_and_output_weights") else
                       "embedding.word_embeddings.weight", (f"{hf}shared_head.head.weight",), partition_dim=0)]
    return rules


def _rope_config(flags: dict) -> dict:
    rope = {"rope_type": "default", "rope_theta": float(flags.get("rotary_base", 10000.0))}
    if (flags.get("rope_type") or "yarn") == "yarn":
        rope.update(yarn_rope_parameters(flags, with_mscale=True))
    return rope


def _config(flags: dict, vocab: int) -> dict:
    wanted = {"multi_latent_attention": True, "normalization": "RMSNorm", "swiglu": True, "disable_bias_linear": True,
              "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}
    for key, value in wanted.items():
        if flags.get(key) != value:
            raise ValueError(f"run flag {key}={flags.get(key)!r} cannot be exported as Hugging Face 'deepseek_v3' "
                             f"(it needs {value!r})")
    pattern, expert_ffn = moe_layer_pattern(flags), flags.get("moe_ffn_hidden_size") or flags["ffn_hidden_size"]
    dense = next((i for i, is_moe in enumerate(pattern) if is_moe), len(pattern))
    if not all(pattern[dense:]):
        raise ValueError(f"run flag moe_layer_freq={flags.get('moe_layer_freq')!r} cannot be exported as Hugging "
                         "Face 'deepseek_v3' (dense layers first, then every layer MoE: first_k_dense_replace)")
    shared = flags.get("moe_shared_expert_intermediate_size") or 0
    if shared % expert_ffn:
        raise ValueError(f"moe_shared_expert_intermediate_size {shared} is not a multiple of moe_ffn_hidden_size "
                         f"{expert_ffn}: Hugging Face 'deepseek_v3' counts n_shared_experts")
    heads = flags["num_attention_heads"]
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": vocab,
            "hidden_size": flags["hidden_size"], "intermediate_size": flags.get("ffn_hidden_size"),
            "moe_intermediate_size": expert_ffn, "num_hidden_layers": flags["num_layers"],
            "num_attention_heads": heads, "num_key_value_heads": heads, "n_routed_experts": flags["num_experts"],
            "n_shared_experts": shared // expert_ffn, "num_experts_per_tok": flags.get("moe_router_topk", 2),
            "n_group": flags.get("moe_router_num_groups") or 1, "topk_group": flags.get("moe_router_group_topk") or 1,
            "routed_scaling_factor": flags.get("moe_router_topk_scaling_factor") or 1.0, "norm_topk_prob": True,
            "first_k_dense_replace": dense, "q_lora_rank": flags.get("q_lora_rank"),
            "kv_lora_rank": flags["kv_lora_rank"], "qk_nope_head_dim": flags["qk_head_dim"],
            "qk_rope_head_dim": flags["qk_pos_emb_head_dim"], "v_head_dim": flags["v_head_dim"],
            "num_nextn_predict_layers": flags.get("mtp_num_layers") or 0,
            "rope_interleave": bool(flags.get("rotary_interleaved")), "rope_parameters": _rope_config(flags),
            "max_position_embeddings": flags.get("max_position_embeddings") or flags.get("seq_length"),
            "rms_norm_eps": flags.get("layernorm_epsilon", 1e-6), "hidden_act": "silu", "attention_bias": False,
            "tie_word_embeddings": not flags.get("untie_embeddings_and_output_weights", False),
            "attention_dropout": flags.get("attention_dropout", 0.0),
            "initializer_range": flags.get("init_method_std", 0.02), "use_cache": True}


ADAPTERS = MappingProxyType({"deepseek_v3": Adapter(
    model_type="deepseek_v3", architecture="DeepseekV3ForCausalLM", required=REQUIRED, flags_from_hf=_flags,
    hf_config_from_flags=_config, rules=_export_rules, file_rules=_file_rules,
    ignored=("rotary_emb.inv_freq", *MTP_SHARED_COPIES))})
