"""The Hugging Face families we convert, keyed by config.json's ``model_type``; adding a family is adding a
module with an ``ADAPTER`` and a line here."""
from __future__ import annotations

import importlib
from types import MappingProxyType

from megatron_core.models.hf.base import Adapter

_MODULES = MappingProxyType({"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "qwen2": "qwen2",
                             "qwen3": "qwen3", "mixtral": "mixtral", "qwen3_moe": "qwen3_moe",
                             "deepseek_v3": "deepseek_v3", "gpt_oss": "gpt_oss"})
SUPPORTED = tuple(_MODULES)
_NOT_YET = MappingProxyType({"qwen2_moe": "gated shared experts"})


def get_adapter(model_type) -> Adapter:
    """The adapter of ``model_type``; ValueError naming it and listing the supported ones otherwise."""
    if model_type not in _MODULES:
        why = f" ({_NOT_YET[model_type]})" if model_type in _NOT_YET else ""
        raise ValueError(f"model_type {model_type!r} is not supported yet{why}; supported: {', '.join(SUPPORTED)}")
    module = importlib.import_module(f"megatron_core.models.hf.{_MODULES[model_type]}")
    return module.ADAPTERS[model_type]


def adapter_for_flags(flags: dict, description: str) -> Adapter:
    """The family an export writes: the recorded ``hf_model_type``, else the one the architecture is (GPT-2
    for LayerNorm + GeLU + learned positions; for RMSNorm + SwiGLU + rope: qwen3 with qk-norm, qwen2 with a
    qkv bias only, else llama; with experts: qwen3_moe with qk-norm, else mixtral)."""
    if flags.get("hf_model_type"):
        return get_adapter(flags["hf_model_type"])
    if flags.get("multi_latent_attention"):
        return get_adapter("deepseek_v3")
    if flags.get("quick_geglu") or flags.get("softmax_type", "vanilla") != "vanilla":
        return get_adapter("gpt_oss")
    shape = (flags.get("normalization", "LayerNorm"), bool(flags.get("swiglu")),
             flags.get("position_embedding_type", "learned_absolute"))
    if flags.get("num_experts") and shape != ("RMSNorm", True, "rope"):
        raise ValueError(f"{description} is a mixture-of-experts model with normalization={shape[0]!r}, swiglu="
                         f"{shape[1]}, position_embedding_type={shape[2]!r}: the MoE families we export (mixtral, "
                         "qwen3_moe) need RMSNorm, swiglu, rope")
    if shape == ("LayerNorm", False, "learned_absolute"):
        return get_adapter("gpt2")
    if shape == ("RMSNorm", True, "rope"):
        if flags.get("num_experts"):
            return get_adapter("qwen3_moe" if flags.get("qk_layernorm") else "mixtral")
        if flags.get("qk_layernorm"):
            return get_adapter("qwen3")
        return get_adapter("qwen2" if flags.get("add_qkv_bias") else "llama")
    raise ValueError(f"{description}: normalization={shape[0]!r}, swiglu={shape[1]}, position_embedding_type="
                     f"{shape[2]!r} match no Hugging Face family we export (gpt2: LayerNorm, no swiglu, "
                     "learned_absolute; llama / qwen2 / qwen3: RMSNorm, swiglu, rope)")


__all__ = ["get_adapter", "adapter_for_flags", "SUPPORTED"]
