"""Qwen3: the llama shape with an RMSNorm over each head's query and key (``q_norm`` / ``k_norm``, before rope)
and an explicit ``head_dim`` (often != hidden / heads); no biases unless ``attention_bias`` (refused)."""
from __future__ import annotations

from types import MappingProxyType

from megatron_core.models.hf.base import Adapter
from megatron_core.models.hf.llama import (
    REQUIRED,
    check_exportable,
    dense_flags,
    dense_hf_config,
    dense_rules,
    refuse_biases,
)
from megatron_core.models.hf.qwen2 import refuse_sliding_window


def _flags(config: dict, path: str) -> dict:
    refuse_sliding_window(config, path)
    refuse_biases(config, path, ("attention_bias",))
    return dense_flags(config, path, qk_norm=True)


def _config(flags: dict, vocab: int) -> dict:
    check_exportable(flags, "qwen3", qk_norm=True)
    return {**dense_hf_config(flags, vocab, model_type="qwen3", architecture="Qwen3ForCausalLM"),
            "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": flags["num_layers"]}


ADAPTERS = MappingProxyType({"qwen3": Adapter(model_type="qwen3", architecture="Qwen3ForCausalLM", required=REQUIRED,
                                              flags_from_hf=_flags, hf_config_from_flags=_config, rules=dense_rules)})
