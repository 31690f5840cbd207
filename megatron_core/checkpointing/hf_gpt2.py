"""Hugging Face GPT-2 <-> megatron_core tensors, streamed one tensor at a time.

GPT-2 is our GPT with learned absolute positions, LayerNorm (eps ``layer_norm_epsilon``), biases everywhere,
the tanh GeLU (``gelu_new``; ``openai_gelu`` here) and tied embeddings. HF stores linear weights as Conv1D
``[in, out]`` (ours are ``[out, in]``) and its fused ``c_attn`` as ``[q of all heads; k; v]``, while our
``linear_qkv`` rows are per head group ``[q_h, k_h, v_h]`` (see ``transformer/attention.py``).
``transformers`` is imported only by the functions that need it.
"""
from __future__ import annotations

import json
import os
import shutil
from types import MappingProxyType
from typing import Callable

import torch

from megatron_core.checkpointing.convert import SourceCheckpoint, SourceTensor, fsync_write, parameter_name
from megatron_core.checkpointing.megatron_lm_io import load_pt, regular_file_size
from megatron_core.checkpointing.shard_reader import open_safetensors
from megatron_core.checkpointing.streaming import StreamingSafetensorsWriter
from megatron_core.utils.errors import InputFileError
from megatron_core.utils.progress import progress_bar

# global name suffix -> (HF name suffix, tp partition dim, stride, transform kind)
_LAYER_MAP = MappingProxyType({
    "input_layernorm.weight": ("ln_1.weight", None, "copy"),
    "input_layernorm.bias": ("ln_1.bias", None, "copy"),
    "self_attention.linear_qkv.weight": ("attn.c_attn.weight", 0, "qkv_weight"),
    "self_attention.linear_qkv.bias": ("attn.c_attn.bias", 0, "qkv_bias"),
    "self_attention.linear_proj.weight": ("attn.c_proj.weight", 1, "conv1d"),
    "self_attention.linear_proj.bias": ("attn.c_proj.bias", None, "copy"),
    "pre_mlp_layernorm.weight": ("ln_2.weight", None, "copy"),
    "pre_mlp_layernorm.bias": ("ln_2.bias", None, "copy"),
    "mlp.linear_fc1.weight": ("mlp.c_fc.weight", 0, "conv1d"),
    "mlp.linear_fc1.bias": ("mlp.c_fc.bias", 0, "copy"),
    "mlp.linear_fc2.weight": ("mlp.c_proj.weight", 1, "conv1d"),
    "mlp.linear_fc2.bias": ("mlp.c_proj.bias", None, "copy"),
})
_TOP_MAP = MappingProxyType({
    "embedding.word_embeddings.weight": ("transformer.wte.weight", 0, "copy"),
    "embedding.position_embeddings.weight": ("transformer.wpe.weight", None, "copy"),
    "decoder.final_layernorm.weight": ("transformer.ln_f.weight", None, "copy"),
    "decoder.final_layernorm.bias": ("transformer.ln_f.bias", None, "copy"),
    "output_layer.weight": ("lm_head.weight", 0, "copy"),
})
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def name_map(num_layers: int) -> dict[str, tuple[str, int | None, str]]:
    """``{global name: (HF name, tp partition dim, transform)}`` for a GPT-2 of ``num_layers`` layers."""
    mapping = dict(_TOP_MAP)
    for i in range(num_layers):
        for ours, (theirs, dim, kind) in _LAYER_MAP.items():
            mapping[f"decoder.layers.{i}.{ours}"] = (f"transformer.h.{i}.{theirs}", dim, kind)
    return mapping


def to_mcore(kind: str, tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """An HF tensor in our layout (Conv1D ``[in, out]`` -> ``[out, in]``; c_attn -> per-head [q, k, v])."""
    if kind == "copy":
        return tensor
    if kind == "conv1d":
        return tensor.t().contiguous()
    if kind == "qkv_weight":  # [h, 3 heads d] -> [heads, 3, d, h] -> [3 heads d, h]
        h = tensor.shape[0]
        return tensor.t().reshape(3, heads, -1, h).transpose(0, 1).reshape(-1, h).contiguous()
    if kind == "qkv_bias":
        return tensor.reshape(3, heads, -1).transpose(0, 1).reshape(-1).contiguous()
    raise ValueError(f"unknown transform {kind!r}")


def to_hf(kind: str, tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of ``to_mcore``."""
    if kind == "copy":
        return tensor
    if kind == "conv1d":
        return tensor.t().contiguous()
    if kind == "qkv_weight":  # [3 heads d, h] -> [heads, 3, d, h] -> [3, heads d, h] -> [h, 3 heads d]
        h = tensor.shape[1]
        return tensor.reshape(heads, 3, -1, h).transpose(0, 1).reshape(-1, h).t().contiguous()
    if kind == "qkv_bias":
        return tensor.reshape(heads, 3, -1).transpose(0, 1).reshape(-1).contiguous()
    raise ValueError(f"unknown transform {kind!r}")


_REQUIRED = ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions")  # config.json keys read without default


def _read_hf_config(hf_dir: str) -> dict:
    """config.json of a GPT-2 folder: a JSON object with every size in ``_REQUIRED`` a positive integer."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.lexists(path):
        raise ValueError(f"{hf_dir} is not a Hugging Face model folder: config.json is missing")
    regular_file_size(path)
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InputFileError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise InputFileError(f"{path} is not a JSON object (it holds a {type(config).__name__}): not a model config")
    if config.get("model_type") != "gpt2":
        raise ValueError(f"{path}: model_type is {config.get('model_type')!r}; --model-type GPT imports only "
                         "Hugging Face 'gpt2' models")
    missing = [key for key in _REQUIRED if key not in config]
    if missing:
        raise InputFileError(f"{path}: {missing[0]} is missing (a GPT-2 config.json gives {', '.join(_REQUIRED)})")
    sizes = {key: config[key] for key in _REQUIRED}
    if config.get("n_inner") is not None:
        sizes["n_inner"] = config["n_inner"]
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputFileError(f"{path}: {key} must be a positive integer, got {value!r}")
    if config.get("scale_attn_by_inverse_layer_idx") or config.get("reorder_and_upcast_attn"):
        raise ValueError(f"{path}: scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
    if config.get("scale_attn_weights", True) is False:
        raise ValueError(f"{path}: scale_attn_weights=false (no 1/sqrt(d) scale) is not supported")
    activation = config.get("activation_function", "gelu_new")
    if activation not in _TANH_GELUS + ("gelu",):
        raise ValueError(f"{path}: activation_function {activation!r} is not supported (gelu_new or gelu)")
    return config


def _open_hf_weights(hf_dir: str) -> tuple[dict[str, tuple], Callable[[str], torch.Tensor], str]:
    """``({name: shape}, read(name), file)`` of model.safetensors, or pytorch_model.bin (weights only). Either
    must be a regular file (a symlink into the Hugging Face cache is followed); a damaged one is an
    ``InputFileError`` naming it."""
    path = os.path.join(hf_dir, "model.safetensors")
    if os.path.lexists(path):
        regular_file_size(path)
        with open_safetensors(path) as handle:
            shapes = {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}

        def read(name: str) -> torch.Tensor:
            with open_safetensors(path) as h:
                return h.get_tensor(name)
        return shapes, read, path
    path = os.path.join(hf_dir, "pytorch_model.bin")
    if not os.path.lexists(path):
        raise ValueError(f"{hf_dir} has neither model.safetensors nor pytorch_model.bin")
    state = load_pt(path)
    if not isinstance(state, dict):
        raise InputFileError(f"{path} holds a {type(state).__name__}, not a state dict of tensors")
    tensors = {k: v for k, v in state.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
    return {k: tuple(v.shape) for k, v in tensors.items()}, tensors.__getitem__, path


def read_hf_gpt2(hf_dir: str, base_flags: dict) -> SourceCheckpoint:
    """A Hugging Face GPT-2 folder as a ``SourceCheckpoint``; ``base_flags`` are the run flags' defaults,
    overridden by what config.json says (sizes, eps, GeLU, tokenizer files when present)."""
    config = _read_hf_config(hf_dir)
    heads, layers, vocab = config["n_head"], config["n_layer"], config["vocab_size"]
    raw_shapes, read, file = _open_hf_weights(hf_dir)
    # GPT2Model saves names without the "transformer." prefix GPT2LMHeadModel uses
    raw_name = {(k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}"): k for k in raw_shapes}
    shapes = {full: raw_shapes[raw] for full, raw in raw_name.items()}
    tied = config.get("tie_word_embeddings", True)
    tensors = []
    for ours, (theirs, dim, kind) in name_map(layers).items():
        if ours == "output_layer.weight" and tied:
            continue
        if theirs not in shapes:
            raise ValueError(f"{file} has no tensor {theirs!r} (needed for {ours!r})")
        shape = tuple(reversed(shapes[theirs])) if kind in ("conv1d", "qkv_weight") else shapes[theirs]
        load = (lambda t=theirs, k=kind: to_mcore(k, read(raw_name[t]).float(), heads))
        tensors.append(SourceTensor(name=ours, shape=shape, dtype=torch.float32, partition_dim=dim, stride=1,
                                    load=load))
    return SourceCheckpoint(description=hf_dir, tensors=tensors, true_vocab_size=vocab,
                            flags={**base_flags, **_flags_from_hf(config, hf_dir, tied)})


def _flags_from_hf(config: dict, hf_dir: str, tied: bool) -> dict:
    n_embd, positions = config["n_embd"], config["n_positions"]
    flags = {"num_layers": config["n_layer"], "hidden_size": n_embd, "num_attention_heads": config["n_head"],
             "ffn_hidden_size": config.get("n_inner") or 4 * n_embd, "seq_length": positions,
             "max_position_embeddings": positions, "layernorm_epsilon": config.get("layer_norm_epsilon", 1e-5),
             "openai_gelu": config.get("activation_function", "gelu_new") in _TANH_GELUS,
             "hidden_dropout": config.get("resid_pdrop", 0.1), "attention_dropout": config.get("attn_pdrop", 0.1),
             "init_method_std": config.get("initializer_range", 0.02), "untie_embeddings_and_output_weights": not tied,
             "position_embedding_type": "learned_absolute", "normalization": "LayerNorm", "swiglu": False,
             "disable_bias_linear": False, "group_query_attention": False, "num_query_groups": None,
             "kv_channels": None}
    vocab_file, merge_file = os.path.join(hf_dir, "vocab.json"), os.path.join(hf_dir, "merges.txt")
    if os.path.exists(vocab_file) and os.path.exists(merge_file):
        flags.update(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file, vocab_size=None)
    else:  # ids only: NullTokenizer's vocab is vocab_size + 1 (its eod)
        flags.update(tokenizer_type="NullTokenizer", vocab_size=config["vocab_size"] - 1, vocab_file=None,
                     merge_file=None)
    return flags


def _check_exportable(flags: dict, description: str) -> None:
    wanted = {"normalization": "LayerNorm", "position_embedding_type": "learned_absolute", "swiglu": False,
              "disable_bias_linear": False, "group_query_attention": False}
    for key, value in wanted.items():
        if flags.get(key, value) != value:
            raise ValueError(f"{description}: config {key}={flags.get(key)!r} cannot be exported as GPT-2 "
                             f"(needs {value!r})")
    if flags.get("kv_channels") not in (None, flags["hidden_size"] // flags["num_attention_heads"]):
        raise ValueError(f"{description}: kv_channels {flags['kv_channels']} != hidden/heads cannot be GPT-2")


def hf_config_from_flags(flags: dict, vocab: int, positions: int) -> dict:
    """The config.json of a GPT2LMHeadModel with the architecture the run flags describe."""
    tied = not flags.get("untie_embeddings_and_output_weights", False)
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab,
              "n_positions": positions, "n_embd": flags["hidden_size"], "n_layer": flags["num_layers"],
              "n_head": flags["num_attention_heads"], "n_inner": flags.get("ffn_hidden_size"),
              "activation_function": "gelu_new" if flags.get("openai_gelu") else "gelu",
              "layer_norm_epsilon": flags.get("layernorm_epsilon", 1e-5),
              "resid_pdrop": flags.get("hidden_dropout", 0.0), "embd_pdrop": flags.get("hidden_dropout", 0.0),
              "attn_pdrop": flags.get("attention_dropout", 0.0),
              "initializer_range": flags.get("init_method_std", 0.02),
              "tie_word_embeddings": tied, "torch_dtype": "float32"}
    if flags.get("tokenizer_type") in (None, "ByteTokenizer", "NullTokenizer", "GPT2BPETokenizer"):
        config["bos_token_id"] = config["eos_token_id"] = vocab - 1  # their eod is the last id
    return config


def write_hf_gpt2(source: SourceCheckpoint, save_dir: str, *, progress: bool = True) -> str:
    """Writes ``source`` (optimizer states ignored) as config.json + model.safetensors that
    ``transformers.GPT2LMHeadModel.from_pretrained(save_dir)`` loads; copies GPT-2 tokenizer files."""
    flags = source.flags
    _check_exportable(flags, source.description)
    mapping = name_map(flags["num_layers"])
    tied = not flags.get("untie_embeddings_and_output_weights", False)
    by_name = {t.name: t for t in source.tensors if parameter_name(t.name) == t.name}
    wanted = [n for n in mapping if not (tied and n == "output_layer.weight")]
    missing = [n for n in wanted if n not in by_name]
    if missing:
        raise ValueError(f"{source.description} has no tensor {missing[0]!r} (and {len(missing) - 1} more)")
    declared = []
    for name in wanted:
        theirs, _, kind = mapping[name]
        shape = tuple(reversed(by_name[name].shape)) if kind in ("conv1d", "qkv_weight") else by_name[name].shape
        declared.append((theirs, by_name[name].dtype, shape))
    os.makedirs(save_dir, exist_ok=True)
    writer = StreamingSafetensorsWriter(os.path.join(save_dir, "model.safetensors"), declared)
    for name in progress_bar(wanted, desc="exporting", unit=" tensors", enabled=progress):
        theirs, _, kind = mapping[name]
        writer.write(theirs, to_hf(kind, by_name[name].load(), flags["num_attention_heads"]))
    writer.close()
    positions = by_name["embedding.position_embeddings.weight"].shape[0]
    config = hf_config_from_flags(flags, source.true_vocab_size, positions)
    fsync_write(os.path.join(save_dir, "config.json"), json.dumps(config, indent=2).encode())
    if flags.get("tokenizer_type") == "GPT2BPETokenizer":
        for key, file in (("vocab_file", "vocab.json"), ("merge_file", "merges.txt")):
            if flags.get(key) and os.path.abspath(flags[key]) != os.path.abspath(os.path.join(save_dir, file)):
                shutil.copyfile(flags[key], os.path.join(save_dir, file))
    return save_dir


__all__ = ["read_hf_gpt2", "write_hf_gpt2", "name_map", "to_mcore", "to_hf", "hf_config_from_flags"]
