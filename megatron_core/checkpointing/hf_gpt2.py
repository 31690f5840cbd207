"""Hugging Face GPT-2 import and export: kept for its public names; the code lives in ``megatron_core.models.hf``
(``gpt2.py`` holds the table, ``io.py`` the streaming shared by every family)."""
from __future__ import annotations

from types import MappingProxyType

import torch

from megatron_core.checkpointing.convert import SourceCheckpoint
from megatron_core.models.hf import gpt2 as _gpt2
from megatron_core.models.hf.base import dims_of
from megatron_core.models.hf.io import read_hf, write_hf

_KINDS = MappingProxyType({"copy": _gpt2.COPY, "conv1d": _gpt2.CONV1D, "qkv_weight": _gpt2.GPT2_QKV,
                           "qkv_bias": _gpt2.GPT2_QKV})


def read_hf_gpt2(hf_dir: str, base_flags: dict) -> SourceCheckpoint:
    """A Hugging Face GPT-2 folder as a ``SourceCheckpoint`` (see ``megatron_core.models.hf.read_hf``)."""
    source = read_hf(hf_dir, base_flags)
    if source.flags["hf_model_type"] != "gpt2":
        raise ValueError(f"{hf_dir}/config.json: model_type is {source.flags['hf_model_type']!r}; read_hf_gpt2 "
                         "imports only 'gpt2' (use megatron_core.models.hf.read_hf)")
    return source


def write_hf_gpt2(source: SourceCheckpoint, save_dir: str, *, progress: bool = True) -> str:
    """Writes ``source`` as a folder ``transformers.GPT2LMHeadModel.from_pretrained(save_dir)`` loads."""
    return write_hf(source, save_dir, progress=progress)


def name_map(num_layers: int) -> dict[str, tuple[str, int | None, str]]:
    """``{global name: (HF name, tp partition dim, transform)}`` for a GPT-2 of ``num_layers`` layers."""
    rules = _gpt2.rules({"num_layers": num_layers, "untie_embeddings_and_output_weights": True})
    def kind(rule) -> str:
        if rule.transform.name == "gpt2_qkv":
            return "qkv_bias" if rule.ours.endswith(".bias") else "qkv_weight"
        return rule.transform.name
    return {r.ours: (r.theirs[0], r.partition_dim, kind(r)) for r in rules}


def _dims(heads: int):
    return dims_of({"num_attention_heads": heads, "hidden_size": heads})


def to_mcore(kind: str, tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """An HF GPT-2 tensor in our layout."""
    if kind not in _KINDS:
        raise ValueError(f"unknown transform {kind!r}")
    return _KINDS[kind].to_ours([tensor], _dims(heads))


def to_hf(kind: str, tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of ``to_mcore``."""
    if kind not in _KINDS:
        raise ValueError(f"unknown transform {kind!r}")
    return _KINDS[kind].to_hf(tensor, _dims(heads))[0]


def hf_config_from_flags(flags: dict, vocab: int, positions: int) -> dict:
    """The config.json of a GPT2LMHeadModel with the architecture the run flags describe."""
    return _gpt2.hf_config_from_flags({**flags, "max_position_embeddings": positions}, vocab)


__all__ = ["read_hf_gpt2", "write_hf_gpt2", "name_map", "to_mcore", "to_hf", "hf_config_from_flags"]
