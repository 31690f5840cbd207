"""Megatron-LM GPT checkpoints (megatron-core ``GPTModel``) <-> megatron_core tensors.

megatron-core's GPTModel and ours share parameter names (``embedding.word_embeddings.weight``,
``decoder.layers.<i>.self_attention.linear_qkv.weight``, ...), the fused QKV layout (per query group
``[q heads; k; v]``), SwiGLU's ``[gate; up]`` halves per tp shard, zero-centered norm weights with
``--apply-layernorm-1p`` and the vocab padding rule. What differs is only where tensors live:

* Transformer Engine layers fuse the norms into the next linear: ``input_layernorm.weight`` is
  ``self_attention.linear_qkv.layer_norm_weight`` and ``pre_mlp_layernorm.weight`` is
  ``mlp.linear_fc1.layer_norm_weight`` (both names are read; the local-spec names are written).
* ``torch`` format: per (tp, pp) rank files with stage-local layer numbers (``model0``... with virtual
  pipelining); ``torch_dist``: global tensors, ``decoder.layers.<rest>`` stacked over all layers, norms under
  the Transformer Engine names.

File access is in ``megatron_lm_io`` (no code from a checkpoint runs).
"""
from __future__ import annotations

import argparse
import os
from types import MappingProxyType
from typing import Any, Callable, Optional

import torch

from megatron_core.checkpointing import megatron_lm_io as mio
from megatron_core.checkpointing.convert import SourceCheckpoint, SourceTensor, is_vocab_tensor
from megatron_core.checkpointing.durable import fsync_write, publish_folder, remove_path
from megatron_core.checkpointing.layout import merge_shards, repad_vocab, take_shard
from megatron_core.tensor_parallel import vocab_size_with_padding
from megatron_core.utils.errors import InputFileError

_TE_NAMES = MappingProxyType({"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
             "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
             "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
             "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"})
_TO_TE = MappingProxyType({ours: theirs for theirs, ours in _TE_NAMES.items()})
_EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
                        "mlp.linear_fc2")
_LAYERS = "decoder.layers."


def partition_of(name: str, swiglu: bool) -> tuple[Optional[int], int]:
    """``(tp partition dim or None, stride)`` of a GPT parameter (our global name)."""
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias")):
        return 0, 1
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return 0, 2 if swiglu else 1
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1, 1
    return None, 1


def _our_layer_name(rest: str) -> str:
    """Layer-relative name in our naming (Transformer Engine's fused-norm names renamed)."""
    return _TE_NAMES.get(rest, rest)


def _check_args(args: dict, where: str) -> None:
    """Refuses what megatron_core's GPT cannot represent, naming the Megatron-LM argument."""
    refusals = [("num_experts", lambda v: v not in (None, 0), "mixture of experts is not built yet"),
                ("multi_latent_attention", bool, "multi-latent attention is not built"),
                ("apply_residual_connection_post_layernorm", bool, "post-layernorm residuals are not built"),
                ("squared_relu", bool, "squared ReLU is not built"),
                ("rotary_interleaved", bool, "interleaved rotary embeddings are not built"),
                ("use_rope_scaling", bool, "Llama-3 rope scaling is not converted yet"),
                ("mtp_num_layers", lambda v: v not in (None, 0), "multi-token prediction is not built"),
                ("position_embedding_type", lambda v: v not in ("learned_absolute", "rope", "none"),
                 "only learned_absolute, rope and none position embeddings are built"),
                ("normalization", lambda v: v not in ("LayerNorm", "RMSNorm"), "only LayerNorm and RMSNorm are built")]
    for key, refused, why in refusals:
        if key in args and refused(args[key]):
            raise ValueError(f"{where}: {key}={args[key]!r} cannot be converted: {why}")
    if args.get("add_qkv_bias") and not args.get("add_bias_linear", True):
        raise ValueError(f"{where}: add_qkv_bias=True with add_bias_linear=False cannot be converted (no flag for "
                         "a QKV-only bias here)")


def flags_from_megatron_args(args: dict, base_flags: dict, where: str) -> dict:
    """Our run flags (``base_flags`` overridden) for the model Megatron-LM's ``args`` describe."""
    _check_args(args, where)
    flags = dict(base_flags)
    same = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
            "group_query_attention", "num_query_groups", "max_position_embeddings", "seq_length",
            "position_embedding_type", "rotary_percent", "rotary_base", "rotary_seq_len_interpolation_factor",
            "normalization", "apply_layernorm_1p", "qk_layernorm", "swiglu", "openai_gelu",
            "untie_embeddings_and_output_weights", "make_vocab_size_divisible_by", "hidden_dropout",
            "attention_dropout", "init_method_std", "tokenizer_type", "vocab_file", "merge_file", "tokenizer_model",
            "vocab_size", "seed", "fp16", "bf16", "tensor_model_parallel_size", "pipeline_model_parallel_size",
            "sequence_parallel", "micro_batch_size", "global_batch_size", "lr", "min_lr")
    flags.update({key: args[key] for key in same if key in args})
    flags["layernorm_epsilon"] = args.get("norm_epsilon", args.get("layernorm_epsilon", 1e-5))
    flags["disable_bias_linear"] = not args.get("add_bias_linear", True)
    flags["num_layers_per_virtual_pipeline_stage"] = None
    if flags.get("position_embedding_type") == "none":
        flags["add_position_embedding"] = False
    return flags


def _true_vocab(args: dict, padded: int, override: Optional[int]) -> int:
    """The unpadded vocab: ``override``; NullTokenizer's ``vocab_size + 1``; else the padded size (all rows)."""
    if override is not None:
        if not 0 < override <= padded:
            raise ValueError(f"--true-vocab-size {override} must be in [1, {padded}] (the checkpoint's padded vocab)")
        return override
    if args.get("tokenizer_type") == "NullTokenizer" and args.get("vocab_size"):
        return int(args["vocab_size"]) + 1
    return padded


def _namespace_dict(value: Any, where: str) -> dict:
    if not isinstance(value, argparse.Namespace):
        raise ValueError(f"{where} has no Megatron-LM 'args' (got {type(value).__name__}); megatron-core "
                         "checkpoints written without Megatron-LM's training loop cannot be converted")
    return {k: v for k, v in vars(value).items() if not isinstance(v, mio.Opaque)}


def read_megatron_lm_checkpoint(load_dir: str, base_flags: dict, *,
                                true_vocab_size: Optional[int] = None) -> SourceCheckpoint:
    """A Megatron-LM GPT checkpoint (``torch`` or ``torch_dist`` format, any tp/pp) as a ``SourceCheckpoint``.

    Args:
        load_dir: the ``--save`` folder (with ``latest_checkpointed_iteration.txt``) or one ``iter_N`` folder.
        base_flags: our run flags' defaults; the checkpoint's ``args`` override the model ones.
        true_vocab_size: the tokenizer's vocab (Megatron-LM's ``--true-vocab-size``); default:
            NullTokenizer's from ``args``, else every padded row is kept.
    Returns: the model weights (no optimizer states: Megatron-LM's optimizer layout is not converted).
    """
    folder, iteration = mio.iteration_folder(load_dir)
    fmt = mio.detect_format(folder)
    if fmt == "torch":
        return _read_torch_format(folder, iteration, base_flags, true_vocab_size)
    if fmt == "torch_dist":
        return _read_torch_dist(folder, iteration, base_flags, true_vocab_size)
    raise ValueError(f"{folder} is not a Megatron-LM checkpoint this converter reads "
                     f"({'format ' + repr(fmt) if fmt else 'neither mp_rank_* folders nor a torch_dist metadata.json'}"
                     "; supported: torch, torch_dist)")


def _source(where: str, args: dict, iteration: int, tensors: list[SourceTensor], true_vocab: int,
            base_flags: dict, tp: int, pp: int) -> SourceCheckpoint:
    flags = flags_from_megatron_args(args, base_flags, where)
    return SourceCheckpoint(description=where, tensors=tensors, true_vocab_size=true_vocab, flags=flags,
                            iteration=iteration, consumed_samples=int(args.get("consumed_train_samples") or 0),
                            layout={"tp": tp, "pp": pp, "dp": 1, "vpp": None, "zero_stage": 0})


def _chunk_dicts(checkpoint: dict, path: str) -> list[dict]:
    chunks = ["model"] if "model" in checkpoint else []
    chunks = chunks or sorted((k for k in checkpoint if k.startswith("model") and k[5:].isdigit()),
                              key=lambda k: int(k[5:]))
    if not chunks:
        raise ValueError(f"{path} has no 'model' (or 'model0', ...) state dict")
    states = [checkpoint[k] for k in chunks]
    for key, state in zip(chunks, states):
        if not isinstance(state, dict):
            raise InputFileError(f"{path}: {key!r} holds a {type(state).__name__}, not a state dict")
    if any("language_model" in state for state in states):
        raise ValueError(f"{path} was written by Megatron-LM's legacy GPT model (--use-legacy-models, names "
                         "language_model.*); only megatron-core GPTModel checkpoints are converted")
    return states


class _RankFiles:
    """The ``model_optim_rng.pt`` of every (tp, pp) rank of a torch-format folder, each loaded once (weights
    only) and checked to hold what the converter reads."""

    def __init__(self, folder: str) -> None:
        self.files = mio.legacy_rank_files(folder)
        self.tp, self.pp = 1 + max(t for t, _ in self.files), 1 + max(p for _, p in self.files)
        self._loaded: dict[str, dict] = {}

    def checkpoint(self, tp_rank: int, pp_rank: int) -> dict:
        path = self.files[(tp_rank, pp_rank)]
        if path not in self._loaded:
            loaded = mio.load_pt(path)
            if not isinstance(loaded, dict):
                raise InputFileError(f"{path} holds a {type(loaded).__name__}, not a Megatron-LM checkpoint dict")
            self._loaded[path] = loaded
        return self._loaded[path]

    def chunks(self, tp_rank: int, pp_rank: int) -> list[dict]:
        """The model state dicts (one per virtual-pipeline chunk) of rank (tp, pp)."""
        return _chunk_dicts(self.checkpoint(tp_rank, pp_rank), self.files[(tp_rank, pp_rank)])

    def tensor(self, tp_rank: int, pp_rank: int, chunk: int, key: str) -> torch.Tensor:
        chunks = self.chunks(tp_rank, pp_rank)
        value = chunks[chunk].get(key) if chunk < len(chunks) else None
        if not isinstance(value, torch.Tensor):
            raise InputFileError(f"{self.files[(tp_rank, pp_rank)]} has no tensor {key!r}"
                                 + (" (the tp rank 0 file has it)" if tp_rank else ""))
        return value


def _read_torch_format(folder: str, iteration: int, base_flags: dict, vocab_override: Optional[int]):
    ranks = _RankFiles(folder)
    tp, pp = ranks.tp, ranks.pp
    args = _namespace_dict(ranks.checkpoint(0, 0).get("args"), ranks.files[(0, 0)])
    swiglu = bool(args.get("swiglu"))
    # [(global name, local key, pp rank, chunk)], layers numbered in Megatron's global order (chunk-major)
    chunks = [ranks.chunks(0, p) for p in range(pp)]
    entries, offset = [], 0
    for v in range(len(chunks[0])):
        for p in range(pp):
            state = chunks[p][v]
            local_layers = sorted({int(k.split(".")[2]) for k in state if k.startswith(_LAYERS)})
            for key, value in state.items():
                if not isinstance(value, torch.Tensor) or key.endswith("_extra_state"):
                    continue
                name = key
                if key.startswith(_LAYERS):
                    _, _, index, rest = key.split(".", 3)
                    name = f"{_LAYERS}{offset + int(index)}.{_our_layer_name(rest)}"
                if name == "output_layer.weight" and not args.get("untie_embeddings_and_output_weights") and pp > 1:
                    continue  # the last stage's copy of the tied embedding
                entries.append((name, key, p, v))
            offset += len(local_layers)
    padded = int(ranks.tensor(0, 0, 0, "embedding.word_embeddings.weight").shape[0]) * tp
    true_vocab = _true_vocab(args, padded, vocab_override)

    def loader(key: str, p: int, v: int, dim: Optional[int], stride: int, vocab: bool) -> Callable[[], torch.Tensor]:
        def read() -> torch.Tensor:
            shards = [ranks.tensor(t, p, v, key) for t in range(tp if dim is not None else 1)]
            full = merge_shards([s.detach().clone() for s in shards], dim, stride)
            return full[:true_vocab] if vocab else full
        return read

    tensors = []
    for name, key, p, v in entries:
        dim, stride = partition_of(name, swiglu)
        local = chunks[p][v][key]
        shape = list(local.shape)
        if dim is not None:
            shape[dim] *= tp
        if is_vocab_tensor(name):
            shape[0] = true_vocab
        tensors.append(SourceTensor(name=name, shape=tuple(shape), dtype=local.dtype, partition_dim=dim,
                                    stride=stride, load=loader(key, p, v, dim, stride, is_vocab_tensor(name))))
    return _source(folder, args, iteration, tensors, true_vocab, base_flags, tp, pp)


def _read_torch_dist(folder: str, iteration: int, base_flags: dict, vocab_override: Optional[int]):
    if not os.path.lexists(os.path.join(folder, "common.pt")):
        raise ValueError(f"torch_dist checkpoint {folder} has no common.pt (where Megatron-LM keeps its args)")
    common_path, _ = mio.file_inside(folder, "common.pt")
    common = mio.load_pt(common_path)
    args = _namespace_dict(common.get("args") if isinstance(common, dict) else None, common_path)
    reader = mio.DcpTensorReader(folder)
    swiglu = bool(args.get("swiglu"))
    if "embedding.word_embeddings.weight" not in reader.tensors:
        raise ValueError(f"torch_dist checkpoint {folder} has no embedding.word_embeddings.weight: not a GPT model")
    true_vocab = _true_vocab(args, reader.tensors["embedding.word_embeddings.weight"][0][0], vocab_override)
    cached: dict[str, torch.Tensor] = {}

    def read_key(key: str) -> torch.Tensor:  # keeps the last stacked tensor: its layers are read in a row
        if key not in cached:
            cached.clear()
            cached[key] = reader.read(key)
        return cached[key]

    tensors = []
    for key in sorted(reader.tensors):  # stacked keys in a row, so each is read once
        if key.startswith(_LAYERS.rstrip(".") + ".") and not key.startswith(_LAYERS):
            continue
        shape, dtype = reader.tensors[key]
        if key.startswith(_LAYERS):
            rest = _our_layer_name(key[len(_LAYERS):])
            for layer in range(shape[0]):
                name = f"{_LAYERS}{layer}.{rest}"
                dim, stride = partition_of(name, swiglu)
                tensors.append(SourceTensor(name=name, shape=tuple(shape[1:]), dtype=dtype, partition_dim=dim,
                                            stride=stride, load=lambda k=key, i=layer: read_key(k)[i].clone()))
            continue
        if key == "output_layer.weight" and not args.get("untie_embeddings_and_output_weights"):
            continue
        dim, stride = partition_of(key, swiglu)
        vocab = is_vocab_tensor(key)
        full_shape = (true_vocab, *shape[1:]) if vocab else shape
        tensors.append(SourceTensor(name=key, shape=tuple(full_shape), dtype=dtype, partition_dim=dim, stride=stride,
                                    load=lambda k=key, n=vocab: read_key(k)[:true_vocab] if n else read_key(k)))
    tp, pp = int(args.get("tensor_model_parallel_size", 1)), int(args.get("pipeline_model_parallel_size", 1))
    return _source(folder, args, iteration, tensors, true_vocab, base_flags, tp, pp)


def megatron_args(flags: dict, *, true_vocab: int, padded_vocab: int, tp: int, pp: int, iteration: int,
                  consumed_samples: int, ckpt_format: str) -> argparse.Namespace:
    """The Megatron-LM ``args`` a converted checkpoint records (what Megatron-LM's load compares)."""
    values = {key: flags.get(key) for key in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels", "group_query_attention",
        "num_query_groups", "max_position_embeddings", "seq_length", "position_embedding_type", "rotary_percent",
        "rotary_base", "rotary_seq_len_interpolation_factor", "normalization", "apply_layernorm_1p", "qk_layernorm",
        "swiglu", "openai_gelu", "untie_embeddings_and_output_weights", "make_vocab_size_divisible_by",
        "hidden_dropout", "attention_dropout", "init_method_std", "tokenizer_type", "vocab_file", "merge_file",
        "tokenizer_model", "vocab_size", "seed", "fp16", "bf16", "micro_batch_size", "global_batch_size")}
    values["kv_channels"] = values["kv_channels"] or flags["hidden_size"] // flags["num_attention_heads"]
    values["num_query_groups"] = values["num_query_groups"] or flags["num_attention_heads"]
    values["ffn_hidden_size"] = values["ffn_hidden_size"] or 4 * flags["hidden_size"]
    values.update(norm_epsilon=flags.get("layernorm_epsilon", 1e-5),
                  add_bias_linear=not flags.get("disable_bias_linear"),
                  add_qkv_bias=False,
                  add_position_embedding=flags.get("position_embedding_type") == "learned_absolute",
                  padded_vocab_size=padded_vocab, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                  virtual_pipeline_model_parallel_size=None, sequence_parallel=bool(flags.get("sequence_parallel"))
                  and tp > 1, iteration=iteration, consumed_train_samples=consumed_samples,
                  consumed_valid_samples=0, ckpt_format=ckpt_format, use_legacy_models=False,
                  transformer_impl="local", true_vocab_size=true_vocab)
    return argparse.Namespace(**values)


def _full_tensors(source: SourceCheckpoint, *, tied: bool) -> dict[str, torch.Tensor]:
    """Our global name -> full tensor (model weights only; a tied output layer left out)."""
    out = {}
    for tensor in source.tensors:
        if tensor.name.startswith("optim/") or (tied and tensor.name == "output_layer.weight"):
            continue
        out[tensor.name] = tensor.load()
    return out


def write_megatron_lm_checkpoint(source: SourceCheckpoint, save_dir: str, *, tp: int, pp: int,
                                 ckpt_format: str = "torch") -> str:
    """Writes ``source``'s weights as a Megatron-LM checkpoint that megatron-core's GPTModel (local layer spec,
    ``--transformer-impl local``) loads: ``torch`` format (``mp_rank_*`` files, ``strict`` load) or
    ``torch_dist`` (``dist_checkpointing.load``); returns the ``iter_N`` folder. Optimizer and RNG states are
    not written (resume with ``--no-load-optim --no-load-rng``)."""
    flags = source.flags
    layers = int(flags["num_layers"])
    if layers % pp:
        raise ValueError(f"num_layers {layers} is not divisible by --target-pipeline-parallel-size {pp} (Megatron-LM "
                         "checkpoints written here split layers evenly)")
    padded = vocab_size_with_padding(source.true_vocab_size, tensor_model_parallel_size=tp,
                                     make_vocab_size_divisible_by=int(flags.get("make_vocab_size_divisible_by", 128)))
    tied = not flags.get("untie_embeddings_and_output_weights")
    full = _full_tensors(source, tied=tied)
    for name in list(full):
        if is_vocab_tensor(name):
            full[name] = repad_vocab(full[name], source.true_vocab_size, padded)
    args = megatron_args(flags, true_vocab=source.true_vocab_size, padded_vocab=padded, tp=tp, pp=pp,
                         iteration=source.iteration, consumed_samples=source.consumed_samples, ckpt_format=ckpt_format)
    folder = os.path.join(save_dir, f"iter_{source.iteration:07d}")
    partial = folder + ".partial"
    os.makedirs(save_dir, exist_ok=True)
    remove_path(partial)  # a leftover or a planted link: removed, never followed
    os.mkdir(partial)
    common = {"args": args, "checkpoint_version": 3.0, "iteration": source.iteration}
    if ckpt_format == "torch":
        _write_torch_format(partial, full, common, tp=tp, pp=pp, layers=layers, tied=tied,
                            swiglu=bool(flags.get("swiglu")))
    elif ckpt_format == "torch_dist":
        _write_torch_dist(partial, full, common, layers=layers)
    else:
        raise ValueError(f"--ckpt-format {ckpt_format!r} is not written here; choose torch or torch_dist")
    remove_path(folder)
    publish_folder(partial, folder)
    fsync_write(os.path.join(save_dir, mio.LATEST), str(source.iteration).encode())
    return folder


def _write_torch_format(folder: str, full: dict, common: dict, *, tp: int, pp: int, layers: int, tied: bool,
                        swiglu: bool) -> None:
    per_stage = layers // pp
    for p in range(pp):
        for t in range(tp):
            state: dict[str, Any] = {}
            for name, tensor in full.items():
                key = name
                if name.startswith(_LAYERS):
                    index, rest = name[len(_LAYERS):].split(".", 1)
                    if int(index) // per_stage != p:
                        continue
                    key = f"{_LAYERS}{int(index) % per_stage}.{rest}"
                elif name.startswith("embedding.") and p != 0:
                    continue
                elif name.startswith(("decoder.final_layernorm.", "output_layer.")) and p != pp - 1:
                    continue
                dim, stride = partition_of(name, swiglu)
                state[key] = take_shard(tensor, dim, stride, t, tp).clone()
            if tied and pp > 1 and p == pp - 1:  # the last stage's copy of the tied embedding
                state["output_layer.weight"] = take_shard(full["embedding.word_embeddings.weight"], 0, 1, t, tp).clone()
            for i in range(per_stage):
                for module in _EXTRA_STATE_MODULES:
                    state[f"{_LAYERS}{i}.{module}._extra_state"] = None
            if p == pp - 1:
                state["output_layer._extra_state"] = None
            rank_dir = os.path.join(folder, mio.legacy_rank_dir(t, p, pp))
            os.makedirs(rank_dir)
            torch.save({**common, "model": state}, os.path.join(rank_dir, "model_optim_rng.pt"))


def _write_torch_dist(folder: str, full: dict, common: dict, *, layers: int) -> None:
    tensors: dict[str, torch.Tensor] = {}
    stacked: dict[str, list] = {}
    for name, tensor in full.items():
        if name.startswith(_LAYERS):
            index, rest = name[len(_LAYERS):].split(".", 1)
            stacked.setdefault(_LAYERS + _TO_TE.get(rest, rest), [None] * layers)[int(index)] = tensor
        else:
            tensors[name] = tensor
    for key, parts in stacked.items():
        tensors[key] = torch.stack(parts)
    objects = {f"{_LAYERS}{module}._extra_state/shard_{i}_{layers}": None
               for module in _EXTRA_STATE_MODULES for i in range(layers)}
    mio.write_dcp(folder, tensors, objects)
    torch.save(common, os.path.join(folder, "common.pt"))
    fsync_write(os.path.join(folder, "metadata.json"),
                b'{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", '
                b'"common_backend_version": 1}')


__all__ = ["read_megatron_lm_checkpoint", "write_megatron_lm_checkpoint", "flags_from_megatron_args",
           "megatron_args", "partition_of"]
