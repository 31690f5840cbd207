"""Hugging Face folders in and out, tensor by tensor, for every family (the adapters only hold tables).

Reading: config.json -> the family's adapter (by ``model_type``) -> run flags; the weights are
``model.safetensors``, or the shards a ``model.safetensors.index.json`` lists (each a plain file name inside the
folder, a regular file; a missing one is named), or ``pytorch_model.bin``. A quantized folder (config.json's
``quantization_config``: DeepSeek-V3's fp8, gpt-oss's mxfp4) is seen through ``dequantize.dequantized_view``:
its stored pairs appear as the dequantized tensors the rules name. Every tensor's shape is checked
against the config before anything is converted; each is read only when the converter asks for it.

Writing: the adapter's rules turn our tensors into HF ones, packed into ``model.safetensors`` or, past
``max_shard_size``, ``model-0000i-of-0000n.safetensors`` with the index, like ``save_pretrained``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from types import MappingProxyType
from typing import Callable, Optional

import torch

from megatron_core.checkpointing.convert import SourceCheckpoint, SourceTensor, fsync_write, parameter_name
from megatron_core.checkpointing.megatron_lm_io import load_pt, regular_file_size
from megatron_core.checkpointing.shard_reader import open_safetensors
from megatron_core.checkpointing.streaming import StreamingSafetensorsWriter
from megatron_core.models.hf.base import Adapter, Rule, dims_of, expected_shape
from megatron_core.models.hf.dequantize import dequantized_view
from megatron_core.models.hf.registry import adapter_for_flags, get_adapter
from megatron_core.utils.durable import atomic_file
from megatron_core.utils.errors import InputFileError
from megatron_core.utils.progress import progress_bar

INDEX = "model.safetensors.index.json"
DTYPES = MappingProxyType({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16})
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json")


def read_json_object(path: str, what: str) -> dict:
    regular_file_size(path)
    try:
        with open(path, encoding="utf-8") as handle:
            value = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InputFileError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(value, dict):
        raise InputFileError(f"{path} is not a JSON object (it holds a {type(value).__name__}): not {what}")
    return value


def read_hf_config(hf_dir: str) -> tuple[dict, Adapter, str]:
    """``(config.json, its adapter, path)``; every ``adapter.required`` key a positive integer."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.lexists(path):
        raise ValueError(f"{hf_dir} is not a Hugging Face model folder: config.json is missing")
    config = read_json_object(path, "a model config")
    try:
        adapter = get_adapter(config.get("model_type"))
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from error
    for key in adapter.required:
        if key not in config:
            raise InputFileError(f"{path}: {key} is missing (a {adapter.model_type} config.json gives "
                                 f"{', '.join(adapter.required)})")
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputFileError(f"{path}: {key} must be a positive integer, got {value!r}")
    return config, adapter, path


_HEADER_DTYPES = MappingProxyType({"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                                   "F64": torch.float64})


def _safetensors_shapes(path: str) -> dict[str, tuple[tuple, Optional[torch.dtype]]]:
    """``{name: (shape, dtype)}`` from the header (dtype None for one we do not import)."""
    with open_safetensors(path) as handle:
        return {k: (tuple(handle.get_slice(k).get_shape()), _HEADER_DTYPES.get(handle.get_slice(k).get_dtype()))
                for k in handle.keys()}


def _data_layout(path: str) -> dict[str, tuple[torch.dtype, tuple, int]]:
    """``{name: (dtype, shape, byte offset)}`` from a safetensors header (``safe_open`` validated it when the
    folder was opened); tensors of a dtype not imported are left out."""
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(length))
    return {name: (_HEADER_DTYPES[entry["dtype"]], tuple(entry["shape"]), 8 + length + entry["data_offsets"][0])
            for name, entry in header.items() if name != "__metadata__" and entry["dtype"] in _HEADER_DTYPES}


def _reader(path: str) -> Callable[..., torch.Tensor]:
    """``read(name, index=None)``: tensor ``name``, or only its slice ``index`` along dim 0 (one expert of a
    stacked tensor), read with ``readinto`` into a fresh tensor. (Not through the memory map: its pages would
    stay resident beside the copy, doubling the peak for the largest tensor.)"""
    layout: dict[str, tuple[torch.dtype, tuple, int]] = {}

    def read(name: str, index: Optional[int] = None) -> torch.Tensor:
        if not layout:
            layout.update(_data_layout(path))
        if name not in layout:  # a dtype we do not import: the library reads it
            with open_safetensors(path) as handle:
                return handle.get_tensor(name) if index is None else handle.get_slice(name)[index]
        dtype, shape, offset = layout[name]
        if index is not None:
            shape, offset = shape[1:], offset + index * math.prod(shape[1:]) * dtype.itemsize
        out = torch.empty(shape, dtype=dtype)
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        with open(path, "rb") as handle:
            handle.seek(offset)
            count = handle.readinto(view)
        if count != len(view):
            raise InputFileError(f"{path} is truncated: tensor {name!r} needs {len(view)} bytes at offset {offset}, "
                                 f"the file has {count}")
        return out
    return read


def open_hf_weights(hf_dir: str) -> tuple[dict[str, tuple], Callable[..., torch.Tensor], dict[str, str]]:
    """``({name: (shape, dtype)}, read(name, index=None), {name: file})`` of the folder's weights: the sharded
    index, else model.safetensors, else pytorch_model.bin (weights only); ``index`` reads one slice of dim 0."""
    index = os.path.join(hf_dir, INDEX)
    if os.path.lexists(index):
        return _open_sharded(hf_dir, index)
    path = os.path.join(hf_dir, "model.safetensors")
    if os.path.lexists(path):
        regular_file_size(path)  # a symlink into the Hugging Face cache is followed
        shapes = _safetensors_shapes(path)
        return shapes, _reader(path), dict.fromkeys(shapes, path)
    path = os.path.join(hf_dir, "pytorch_model.bin")
    if not os.path.lexists(path):
        raise ValueError(f"{hf_dir} has none of {INDEX}, model.safetensors, pytorch_model.bin")
    state = load_pt(path)
    if not isinstance(state, dict):
        raise InputFileError(f"{path} holds a {type(state).__name__}, not a state dict of tensors")
    tensors = {k: v for k, v in state.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
    return ({k: (tuple(v.shape), v.dtype) for k, v in tensors.items()},
            lambda name, index=None: tensors[name] if index is None else tensors[name][index],
            dict.fromkeys(tensors, path))


def _open_sharded(hf_dir: str, index: str):
    weight_map = read_json_object(index, "a safetensors index").get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise InputFileError(f"{index}: weight_map must be an object of tensor name -> file name")
    shapes, files, readers = {}, {}, {}
    for file in sorted(set(weight_map.values())):
        if os.path.basename(file) != file or file in ("", ".", ".."):
            raise InputFileError(f"{index}: weight_map names {file!r}, not a plain file name inside {hf_dir}")
        path = os.path.join(hf_dir, file)
        if not os.path.lexists(path):
            raise InputFileError(f"shard {path} (listed in {INDEX}'s weight_map) is missing")
        regular_file_size(path)
        in_file = _safetensors_shapes(path)
        readers[file] = _reader(path)
        for name, mapped in weight_map.items():
            if mapped != file:
                continue
            if name not in in_file:
                raise InputFileError(f"{path} has no tensor {name!r} although {INDEX} maps it there")
            shapes[name], files[name] = in_file[name], path
    return shapes, (lambda name, index=None: readers[os.path.basename(files[name])](name, index)), files


def read_hf(hf_dir: str, base_flags: dict, *, params_dtype: Optional[str] = None) -> SourceCheckpoint:
    """A Hugging Face folder as a ``SourceCheckpoint`` (nothing read yet but headers): ``base_flags`` (run
    flag defaults) updated with the family's architecture flags; tensors keep their dtype unless
    ``params_dtype`` ("fp32", "bf16", "fp16") is given."""
    config, adapter, path = read_hf_config(hf_dir)
    flags = {**base_flags, **adapter.flags_from_hf(config, path), "hf_model_type": adapter.model_type}
    vocab = config["vocab_size"]
    raw_shapes, read, files = dequantized_view(config, path, *open_hf_weights(hf_dir),
                                               DTYPES[params_dtype] if params_dtype else None)
    raw_name = {adapter.hf_name(k): k for k in raw_shapes}
    shapes = {full: raw_shapes[raw] for full, raw in raw_name.items()}
    rules = adapter.file_rules(flags, shapes.keys()) if adapter.file_rules else adapter.rules(flags)
    dims, cast = dims_of(flags), DTYPES[params_dtype] if params_dtype else None
    used, tensors = set(), []
    for rule in rules:
        ours_shape = expected_shape(rule.ours, flags, vocab)
        for theirs, wanted in zip(rule.theirs, rule.transform.hf_shapes(ours_shape, dims)):
            if rule.hf_index is not None:  # one expert of a [E, ...] stack
                wanted = (flags.get("num_experts"), *wanted)
            if theirs not in shapes:
                raise InputFileError(f"{hf_dir} has no tensor {theirs!r} (needed for {rule.ours!r})")
            if tuple(shapes[theirs][0]) != tuple(wanted):
                raise InputFileError(f"{files[raw_name[theirs]]}: tensor {theirs!r} has shape "
                                     f"{list(shapes[theirs][0])} but {path} implies {list(wanted)}")
            used.add(theirs)
        dtype = cast or _dtype_of(shapes[rule.theirs[0]][1], files[raw_name[rule.theirs[0]]], rule.theirs[0])

        def load(rule: Rule = rule, dtype: torch.dtype = dtype) -> torch.Tensor:
            parts = [read(raw_name[t], rule.hf_index).to(dtype) for t in rule.theirs]
            return rule.transform.to_ours(parts, dims)
        tensors.append(SourceTensor(name=rule.ours, shape=ours_shape, dtype=dtype, partition_dim=rule.partition_dim,
                                    stride=rule.stride, load=load))
    tied = not flags.get("untie_embeddings_and_output_weights", False)
    extra = [n for n in shapes if n not in used and not n.endswith(adapter.ignored)
             and not (tied and n in adapter.tied_output)]
    if extra:
        raise InputFileError(f"{files[raw_name[extra[0]]]} holds tensor {extra[0]!r} that {path} does not describe "
                             f"({len(extra)} such tensors): a feature this {adapter.model_type} import does not map")
    flags.update(_precision_flags(tensors[0].dtype if tensors else torch.float32))
    flags.update(_tokenizer_flags(hf_dir, vocab, adapter.model_type))
    return SourceCheckpoint(description=hf_dir, tensors=tensors, true_vocab_size=vocab, flags=flags)


def _dtype_of(dtype: Optional[torch.dtype], file: str, name: str) -> torch.dtype:
    if dtype not in DTYPES.values():
        raise InputFileError(f"{file}: tensor {name!r} is {dtype or 'of another dtype'}; Hugging Face imports keep "
                             "fp32, bf16 or fp16 (or give --params-dtype)")
    return dtype


def _precision_flags(dtype: torch.dtype) -> dict:
    return {"bf16": dtype == torch.bfloat16, "fp16": dtype == torch.float16}


def _tokenizer_flags(hf_dir: str, vocab: int, model_type: str) -> dict:
    """GPT-2's BPE files (gpt2), a Hugging Face tokenizer folder, else ids only."""
    bpe = os.path.exists(os.path.join(hf_dir, "vocab.json")) and os.path.exists(os.path.join(hf_dir, "merges.txt"))
    if bpe and model_type == "gpt2":
        return {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": os.path.join(hf_dir, "vocab.json"),
                "merge_file": os.path.join(hf_dir, "merges.txt"), "vocab_size": None}
    if os.path.exists(os.path.join(hf_dir, "tokenizer_config.json")):
        return {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": os.path.abspath(hf_dir),
                "vocab_size": None, "vocab_file": None, "merge_file": None}
    # ids only: NullTokenizer's vocab is vocab_size + 1 (its eod)
    return {"tokenizer_type": "NullTokenizer", "vocab_size": vocab - 1, "vocab_file": None, "merge_file": None}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5e9 bytes, ``"500MiB"`` -> 500 * 2**20, ``"1000"`` -> 1000 (transformers' units)."""
    units = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
    upper = str(text).strip().upper()
    for unit, scale in units.items():
        if upper.endswith(unit) and upper[: -len(unit)].strip().isdigit():
            return int(upper[: -len(unit)]) * scale
    if upper.isdigit():
        return int(upper)
    raise ValueError(f"--max-shard-size {text!r} is not a size (e.g. 5GB, 500MB, 2GiB or a byte count)")


@dataclasses.dataclass
class _ExportItem:
    """HF tensors written together: one rule's, or (``stacked``) every expert's slice of one ``[E, ...]`` tensor
    (rules with ``hf_index``, transformers' fused experts), in expert order."""

    rules: list
    tensors: list
    hf_shapes: list
    stacked: bool = False

    def pieces(self, dims) -> list[torch.Tensor]:
        if not self.stacked:
            return self.rules[0].transform.to_hf(self.tensors[0].load(), dims)
        per_expert = [rule.transform.to_hf(tensor.load(), dims) for rule, tensor in zip(self.rules, self.tensors)]
        return [torch.stack([parts[j] for parts in per_expert]) for j in range(len(self.rules[0].theirs))]


def _plan_export(source: SourceCheckpoint, rules: list[Rule]) -> list[_ExportItem]:
    by_name = {t.name: t for t in source.tensors if parameter_name(t.name) == t.name}
    missing = [r.ours for r in rules if r.ours not in by_name]
    if missing:
        raise ValueError(f"{source.description} has no tensor {missing[0]!r} (and {len(missing) - 1} more)")
    dims = dims_of(source.flags)
    plan, stacks = [], {}
    for rule in sorted(rules, key=lambda r: -1 if r.hf_index is None else r.hf_index):
        tensor = by_name[rule.ours]
        shapes = rule.transform.hf_shapes(tuple(tensor.shape), dims)
        if rule.hf_index is None:
            plan.append(_ExportItem([rule], [tensor], shapes))
            continue
        if rule.theirs not in stacks:
            stacks[rule.theirs] = _ExportItem([], [], [], stacked=True)
            plan.append(stacks[rule.theirs])
        item = stacks[rule.theirs]
        item.rules.append(rule)
        item.tensors.append(tensor)
        item.hf_shapes = [(len(item.rules), *shape) for shape in shapes]
    return plan


def _shards(plan: list[_ExportItem], max_bytes: int) -> list[list[_ExportItem]]:
    """Consecutive groups of the plan (a rule's HF tensors stay together), each under ``max_bytes`` unless
    one rule alone is larger (save_pretrained's rule)."""
    shards, size = [[]], 0
    for item in plan:
        nbytes = sum(int(torch.Size(s).numel()) for s in item.hf_shapes) * item.tensors[0].dtype.itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    return shards


def write_hf(source: SourceCheckpoint, save_dir: str, *, max_shard_size: str = "50GB",
             progress: bool = True) -> str:
    """Writes ``source`` (optimizer states ignored) as a folder ``AutoModelForCausalLM.from_pretrained``
    loads: config.json of the family the flags record (``hf_model_type``, else what the architecture is),
    the weights sharded past ``max_shard_size``, the run's Hugging Face tokenizer files copied."""
    flags = source.flags
    adapter = adapter_for_flags(flags, source.description)
    config = adapter.hf_config_from_flags(flags, source.true_vocab_size)
    dtype = next((t.dtype for t in source.tensors if t.name == "embedding.word_embeddings.weight"), torch.float32)
    config["dtype"] = str(dtype).removeprefix("torch.")
    plan = _plan_export(source, adapter.rules(flags))
    shards = _shards(plan, parse_size(max_shard_size))
    os.makedirs(save_dir, exist_ok=True)
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total, dims = {}, 0, dims_of(flags)
    bar = progress_bar(total=len(plan), desc="exporting", unit=" tensors", enabled=progress)
    for file, shard in zip(names, shards):
        declared = [(theirs, item.tensors[0].dtype, shape) for item in shard
                    for theirs, shape in zip(item.rules[0].theirs, item.hf_shapes)]
        writer = StreamingSafetensorsWriter(os.path.join(save_dir, file), declared)
        for item in shard:
            for theirs, piece in zip(item.rules[0].theirs, item.pieces(dims)):
                writer.write(theirs, piece.to(item.tensors[0].dtype))
                weight_map[theirs] = file
                total += piece.numel() * piece.element_size()
            bar.update(1)
        writer.close()
    bar.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        fsync_write(os.path.join(save_dir, INDEX), json.dumps(index, indent=2).encode())
    fsync_write(os.path.join(save_dir, "config.json"), json.dumps(config, indent=2).encode())
    _copy_tokenizer(flags, save_dir)
    return save_dir


def _copy_tokenizer(flags: dict, save_dir: str) -> None:
    if flags.get("tokenizer_type") == "GPT2BPETokenizer":
        sources = {"vocab.json": flags.get("vocab_file"), "merges.txt": flags.get("merge_file")}
    elif flags.get("tokenizer_type") == "HuggingFaceTokenizer" and flags.get("tokenizer_model") \
            and os.path.isdir(flags["tokenizer_model"]):
        sources = {name: os.path.join(flags["tokenizer_model"], name) for name in TOKENIZER_FILES}
    else:
        return
    for name, path in sources.items():
        target = os.path.join(save_dir, name)
        if path and os.path.isfile(path) and os.path.abspath(path) != os.path.abspath(target):
            with open(path, "rb") as source, atomic_file(target) as out:
                shutil.copyfileobj(source, out)


__all__ = ["read_hf", "write_hf", "read_hf_config", "open_hf_weights", "parse_size", "DTYPES", "INDEX"]
