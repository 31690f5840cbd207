"""Qwen2: the llama shape with a bias on q, k and v (none on o_proj or the MLP) and full attention only."""
from __future__ import annotations

from types import MappingProxyType

from megatron_core.models.hf.base import Adapter, refuse
from megatron_core.models.hf.llama import REQUIRED, check_exportable, dense_flags, dense_hf_config, dense_rules


def refuse_sliding_window(config: dict, path: str) -> None:
    """Qwen's windowed layers (``use_sliding_window`` or a ``sliding_attention`` entry of ``layer_types``)."""
    if config.get("use_sliding_window"):
        raise refuse(path, "use_sliding_window", config["use_sliding_window"], "windowed attention is not built yet")
    kinds = sorted(set(config.get("layer_types") or ["full_attention"]) - {"full_attention"})
    if kinds:
        raise refuse(path, "layer_types", kinds, "every layer must be full_attention (windowed attention is not "
                     "built yet)")


def _flags(config: dict, path: str) -> dict:
    refuse_sliding_window(config, path)
    return dense_flags(config, path, qkv_bias=True)


def _config(flags: dict, vocab: int) -> dict:
    check_exportable(flags, "qwen2", qkv_bias=True)
    return {**dense_hf_config(flags, vocab, model_type="qwen2", architecture="Qwen2ForCausalLM"),
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": flags["num_layers"]}


ADAPTERS = MappingProxyType({"qwen2": Adapter(model_type="qwen2", architecture="Qwen2ForCausalLM", required=REQUIRED,
                                              flags_from_hf=_flags, hf_config_from_flags=_config, rules=dense_rules)})
