"""Qwen3-MoE: the Qwen3 shape (qk-norm, explicit ``head_dim``, no biases) with sparse MoE blocks of
``num_experts`` SwiGLU experts (``moe_intermediate_size`` wide) and, where ``mlp_only_layers`` /
``decoder_sparse_step`` say so, dense MLPs (``intermediate_size`` wide). No shared experts.

Layer ``i`` is MoE when ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0``; we record that as
our ``--moe-layer-freq`` 0/1 list (1 when every layer is MoE) and export it back as ``decoder_sparse_step: 1``
plus ``mlp_only_layers``. ``norm_topk_prob: true`` renormalizes the top-k softmax probabilities (our default
router); ``false`` keeps them (``--moe-router-pre-softmax``). Tensor names: ``mlp.gate.weight`` (router),
``mlp.experts.<e>.{gate,up,down}_proj.weight`` (written and read), or transformers 5's fused
``mlp.experts.gate_up_proj`` / ``down_proj`` (read; see mixtral.py).
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Collection

from megatron_core.models.hf.base import Adapter, Rule, refuse
from megatron_core.models.hf.llama import dense_flags, dense_hf_config, refuse_biases
from megatron_core.models.hf.mixtral import check_moe_exportable, moe_flags, moe_layer_pattern, moe_rules
from megatron_core.models.hf.qwen2 import refuse_sliding_window

REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
            "num_experts_per_tok", "moe_intermediate_size")


def _num_experts(config: dict, path: str) -> int:
    """``num_experts`` (the hub's key) or ``num_local_experts`` (what transformers 5 writes: its alias)."""
    key = "num_experts" if "num_experts" in config else "num_local_experts"
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise refuse(path, key, value, "a qwen3_moe config.json gives a positive number of experts (num_experts "
                     "or num_local_experts)")
    return value


def _pattern(config: dict, path: str) -> list[bool]:
    step, layers = config.get("decoder_sparse_step", 1), config["num_hidden_layers"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise refuse(path, "decoder_sparse_step", step, "it must be a positive integer")
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers
                                          for i in dense):
        raise refuse(path, "mlp_only_layers", dense, f"it must list layer indices in [0, {layers})")
    pattern = [i not in dense and (i + 1) % step == 0 for i in range(layers)]
    if not any(pattern):
        raise refuse(path, "mlp_only_layers", dense, f"with decoder_sparse_step {step} no layer is MoE: convert "
                     "the model as qwen3")
    return pattern


def _flags(config: dict, path: str) -> dict:
    refuse_sliding_window(config, path)
    refuse_biases(config, path, ("attention_bias",))
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if config.get(key):
            raise refuse(path, key, config[key], "Qwen3-MoE has no shared experts (qwen2_moe's are not mapped)")
    flags = dense_flags(config, path, qk_norm=True)
    return {**flags, **moe_flags(experts=_num_experts(config, path), topk=config["num_experts_per_tok"],
                                 expert_ffn=config["moe_intermediate_size"], pattern=_pattern(config, path),
                                 normalize_topk=bool(config.get("norm_topk_prob", False)),
                                 aux_loss_coeff=config.get("router_aux_loss_coef", 0.001))}


def _config(flags: dict, vocab: int) -> dict:
    check_moe_exportable(flags, "qwen3_moe", qk_norm=True)
    pattern = moe_layer_pattern(flags)
    config = dense_hf_config(flags, vocab, model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM")
    return {**config, "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": flags["num_layers"], "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, is_moe in enumerate(pattern) if not is_moe],
            "num_experts": flags["num_experts"], "num_experts_per_tok": flags.get("moe_router_topk", 2),
            "moe_intermediate_size": flags.get("moe_ffn_hidden_size") or config["intermediate_size"],
            "norm_topk_prob": not flags.get("moe_router_pre_softmax", False),
            "router_aux_loss_coef": flags.get("moe_aux_loss_coeff", 0.0), "output_router_logits": False}


def _rules(flags: dict, names: Collection[str] = ()) -> list[Rule]:
    return moe_rules(flags, block="mlp.", router="gate", expert_names=("gate_proj", "up_proj", "down_proj"),
                     names=names)


ADAPTERS = MappingProxyType({"qwen3_moe": Adapter(model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM",
                                                  required=REQUIRED, flags_from_hf=_flags,
                                                  hf_config_from_flags=_config, rules=_rules, file_rules=_rules)})
