"""Mixtral: the Mistral shape (RMSNorm, rope, grouped-query attention, no biases) with every MLP a sparse MoE
block of ``num_local_experts`` SwiGLU experts, ``num_experts_per_tok`` of them per token.

Routing (transformers' ``MixtralTopKRouter``): softmax over all experts, top-k, the k probabilities divided by
their sum. That equals a softmax over the k chosen logits, which is our router's (Megatron's) default
``moe_router_pre_softmax=False``; Qwen3-MoE with ``norm_topk_prob: false`` keeps the k probabilities as they
are, which is ``--moe-router-pre-softmax``. Both are dropless (no capacity), as transformers.

Tensors: the router ``block_sparse_moe.gate.weight`` ``[E, h]`` is our ``mlp.router.weight``; expert e's
``w1`` (gate) and ``w3`` (up), each ``[f, h]``, fuse into our ``mlp.experts.local_experts.<e>.linear_fc1``
``[gate; up]`` and ``w2`` ``[h, f]`` is its ``linear_fc2``. transformers 5 holds the experts as 3-D tensors
(``experts.gate_up_proj`` ``[E, 2f, h]``, ``experts.down_proj`` ``[E, h, f]``) but ``save_pretrained`` writes
(and the hub holds) the per-expert names above: we write those and read both. Experts are not split over
tp (partition None): the converter places each, under its global id, on the ep rank that holds it. The
per-layer helpers here serve qwen3_moe too.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Collection, Sequence

from megatron_core.models.hf.base import GATE_UP, Adapter, Rule, refuse
from megatron_core.models.hf.llama import (
    LAYER,
    OUTPUT,
    QK_NORM,
    TOP,
    check_exportable,
    dense_flags,
    dense_hf_config,
    hf_sliding_window,
    refuse_biases,
    window_flags,
)

ATTENTION = tuple(rule for rule in LAYER if not rule.ours.startswith("mlp."))
DENSE_MLP = tuple(rule for rule in LAYER if rule.ours.startswith("mlp."))
REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
            "num_local_experts", "num_experts_per_tok")


def moe_layer_pattern(flags: dict) -> list[bool]:
    """Which layers are MoE under ``moe_layer_freq`` (``MoEConfig.is_moe_layer``: an int n makes layers 0, n,
    2n, ... MoE; a list gives one 0/1 per layer)."""
    freq, layers = flags.get("moe_layer_freq", 1), flags["num_layers"]
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(layers)]
    return [bool(f) for f in freq]


def layer_freq_of(pattern: Sequence[bool]):
    """``moe_layer_freq`` of a per-layer pattern: 1 when every layer is MoE, else the 0/1 list."""
    return 1 if all(pattern) else [int(p) for p in pattern]


def _fused_experts(experts: int) -> list[Rule]:
    """transformers 5's own layout (``save_pretrained(save_original_format=False)``): ``mlp.gate`` and every
    expert stacked, ``experts.gate_up_proj`` ``[E, 2f, h]`` (each ``[gate; up]``, our fc1) and
    ``experts.down_proj`` ``[E, h, f]``; each of our experts reads its slice."""
    rules = [Rule("mlp.router.weight", ("mlp.gate.weight",))]
    for e in range(experts):
        rules += [Rule(f"mlp.experts.local_experts.{e}.linear_fc1.weight", ("mlp.experts.gate_up_proj",), hf_index=e),
                  Rule(f"mlp.experts.local_experts.{e}.linear_fc2.weight", ("mlp.experts.down_proj",), hf_index=e)]
    return rules


def moe_rules(flags: dict, *, block: str, router: str, expert_names: tuple[str, str, str],
              names: Collection[str] = ()) -> list[Rule]:
    """The tensor map of an MoE model: attention (qk-norm when the flags say) and, per layer, the dense MLP
    or the router and every expert. ``block`` is the HF module of the MoE layer (``block_sparse_moe.`` /
    ``mlp.``), ``router`` its gate, ``expert_names`` the gate, up and down projections of one expert (the
    layout ``save_pretrained`` writes); a layer whose ``experts.gate_up_proj`` is among the file's ``names``
    is read in the fused layout."""
    gate, up, down = expert_names
    rules = [*TOP, *((OUTPUT,) if flags.get("untie_embeddings_and_output_weights") else ())]
    attention = [*ATTENTION, *(QK_NORM if flags.get("qk_layernorm") else ())]
    for i, is_moe in enumerate(moe_layer_pattern(flags)):
        layer = list(attention)
        if is_moe and f"model.layers.{i}.mlp.experts.gate_up_proj" in names:
            layer += _fused_experts(flags["num_experts"])
        elif is_moe:
            layer.append(Rule("mlp.router.weight", (f"{block}{router}.weight",)))
            for e in range(flags["num_experts"]):
                ours, theirs = f"mlp.experts.local_experts.{e}.", f"{block}experts.{e}."
                layer += [Rule(f"{ours}linear_fc1.weight", (f"{theirs}{gate}.weight", f"{theirs}{up}.weight"),
                               GATE_UP),
                          Rule(f"{ours}linear_fc2.weight", (f"{theirs}{down}.weight",))]
        else:
            layer += DENSE_MLP
        rules += [rule.at_layer(i, "decoder.layers.{i}.", "model.layers.{i}.") for rule in layer]
    return rules


def moe_flags(*, experts: int, topk: int, expert_ffn: int, pattern: Sequence[bool], normalize_topk: bool,
              aux_loss_coeff: float) -> dict:
    """Our MoE run flags (Megatron's names) of a softmax top-k router with dropless SwiGLU experts."""
    return {"num_experts": experts, "moe_router_topk": topk, "moe_ffn_hidden_size": expert_ffn,
            "moe_layer_freq": layer_freq_of(pattern), "moe_router_pre_softmax": not normalize_topk,
            "moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False,
            "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": float(aux_loss_coeff),
            "moe_shared_expert_intermediate_size": None, "moe_expert_capacity_factor": None,
            "moe_pad_expert_input_to_capacity": False}


def check_moe_exportable(flags: dict, model_type: str, *, qk_norm: bool) -> None:
    """ValueError naming the run flag an export as ``model_type`` cannot express."""
    check_exportable({**flags, "num_experts": None}, model_type, qk_norm=qk_norm)
    wanted = {"moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False,
              "moe_shared_expert_intermediate_size": None, "moe_expert_capacity_factor": None}
    for key, value in wanted.items():
        if (flags.get(key, value) or None) != (value or None):
            raise ValueError(f"run flag {key}={flags.get(key)!r} cannot be exported as Hugging Face {model_type!r} "
                             f"(it needs {value!r})")


def _flags(config: dict, path: str) -> dict:
    if config.get("router_jitter_noise"):
        raise refuse(path, "router_jitter_noise", config["router_jitter_noise"], "our router multiplies no "
                     "noise into the hidden states")
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if config.get(key):
            raise refuse(path, key, config[key], "Mixtral has no shared experts")
    refuse_biases(config, path, ("attention_bias", "mlp_bias"))
    flags = {**dense_flags(config, path), **window_flags(config, path)}
    return {**flags, **moe_flags(experts=config["num_local_experts"], topk=config["num_experts_per_tok"],
                                 expert_ffn=config["intermediate_size"], pattern=[True] * flags["num_layers"],
                                 normalize_topk=True, aux_loss_coeff=config.get("router_aux_loss_coef", 0.001))}


def _config(flags: dict, vocab: int) -> dict:
    check_moe_exportable(flags, "mixtral", qk_norm=False)
    if not all(moe_layer_pattern(flags)):
        raise ValueError(f"run flag moe_layer_freq={flags.get('moe_layer_freq')!r} cannot be exported as Hugging "
                         "Face 'mixtral' (every Mixtral layer is MoE; qwen3_moe mixes dense layers)")
    if flags.get("moe_router_pre_softmax"):
        raise ValueError("run flag moe_router_pre_softmax=True cannot be exported as Hugging Face 'mixtral' (it "
                         "renormalizes the top-k probabilities; qwen3_moe with norm_topk_prob false does not)")
    expert_ffn = flags.get("moe_ffn_hidden_size") or flags.get("ffn_hidden_size") or 4 * flags["hidden_size"]
    config = dense_hf_config(flags, vocab, model_type="mixtral", architecture="MixtralForCausalLM")
    return {**config, "intermediate_size": expert_ffn, "sliding_window": hf_sliding_window(flags, "mixtral"),
            "num_local_experts":
            flags["num_experts"], "num_experts_per_tok": flags.get("moe_router_topk", 2),
            "router_aux_loss_coef": flags.get("moe_aux_loss_coeff", 0.0), "router_jitter_noise": 0.0,
            "output_router_logits": False}


def _rules(flags: dict, names: Collection[str] = ()) -> list[Rule]:
    return moe_rules(flags, block="block_sparse_moe.", router="gate", expert_names=("w1", "w3", "w2"), names=names)


ADAPTERS = MappingProxyType({"mixtral": Adapter(model_type="mixtral", architecture="MixtralForCausalLM",
                                                required=REQUIRED, flags_from_hf=_flags, hf_config_from_flags=_config,
                                                rules=_rules, file_rules=_rules)})
