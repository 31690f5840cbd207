"""Sharded, atomic, layout-independent checkpoints: safetensors files and one JSON metadata file, no pickle.

    DIR/latest_checkpointed_iteration.txt      the newest complete checkpoint (updated last, atomically)
    DIR/iter_0000020/metadata.json             iteration, consumed samples, vocab, layout, config, scheduler,
                                               every tensor's global shape and tp partition, file checksums
    DIR/iter_0000020/model_tp00_pp000.safetensors   model shards (written by dp rank 0 of each tp x pp)
    DIR/iter_0000020/optim_rank00000.safetensors    optimizer state of each rank (+ optim_rank00000.json)
    DIR/iter_0000020/rng_rank00000.safetensors      RNG states of each rank

Saving writes into ``iter_N.partial``, fsyncs every file, renames the folder to ``iter_N`` and only then
replaces the pointer file, so a crash never leaves a partial checkpoint that looks complete. Model weights
load at any tp/pp layout (shards are merged by their partition record and re-split; the vocab padding is
recomputed from the true vocab size). Optimizer and RNG states load at the same layout only.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from megatron_core.checkpointing.layout import (
    global_named_parameters,
    merge_shards,
    partition_record,
    repad_vocab,
    take_shard,
)
from megatron_core.config import TransformerConfig
from megatron_core.parallel_state import ParallelState
from megatron_core.tensor_parallel import get_rng_tracker

LATEST = "latest_checkpointed_iteration.txt"
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _fsync_write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _layout(state: ParallelState, extra: dict) -> dict:
    return {"tp": state.tp_size, "pp": state.pp_size, "dp": state.dp_size, "vpp": state.vpp_size, **extra}


def flatten_state(tree: Any, prefix: str = "") -> tuple[dict[str, torch.Tensor], Any]:
    """Splits a nested dict/list of tensors and plain values into ``{path: tensor}`` and a JSON skeleton."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree.detach().cpu().contiguous()}, {"__tensor__": prefix}
    if isinstance(tree, dict):
        tensors, skeleton = {}, {}
        for key, value in tree.items():
            sub_tensors, skeleton[str(key)] = flatten_state(value, f"{prefix}/{key}")
            tensors.update(sub_tensors)
        return tensors, {"__dict__": skeleton, "__int_keys__": [str(k) for k in tree if isinstance(k, int)]}
    if isinstance(tree, (list, tuple)):
        tensors, items = {}, []
        for i, value in enumerate(tree):
            sub_tensors, item = flatten_state(value, f"{prefix}/{i}")
            tensors.update(sub_tensors)
            items.append(item)
        return tensors, {"__list__": items}
    return {}, tree


def unflatten_state(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, dict) and "__tensor__" in skeleton:
        return tensors[skeleton["__tensor__"]]
    if isinstance(skeleton, dict) and "__dict__" in skeleton:
        int_keys = set(skeleton["__int_keys__"])
        return {(int(k) if k in int_keys else k): unflatten_state(v, tensors) for k, v in skeleton["__dict__"].items()}
    if isinstance(skeleton, dict) and "__list__" in skeleton:
        return [unflatten_state(v, tensors) for v in skeleton["__list__"]]
    return skeleton


def save_checkpoint(directory: str, *, iteration: int, model_chunks: Sequence[nn.Module], config: TransformerConfig,
                    state: ParallelState, true_vocab_size: int, consumed_samples: int,
                    optimizer: Optional[Any] = None, scheduler: Optional[Any] = None,
                    run_config: Optional[dict] = None, layout_extra: Optional[dict] = None) -> str:
    """Writes checkpoint ``iteration`` (collective: every rank calls it). Returns the checkpoint folder."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = os.path.join(directory, f"iter_{iteration:07d}")
    partial = f"{final}.partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    _barrier()
    records = _save_model_shards(partial, model_chunks, config, state)
    if optimizer is not None:
        tensors, skeleton = flatten_state(optimizer.state_dict())
        save_file(tensors, os.path.join(partial, f"optim_rank{rank:05d}.safetensors"))
        _fsync_write(os.path.join(partial, f"optim_rank{rank:05d}.json"), json.dumps(skeleton).encode())
    save_file(_rng_tensors(state.device), os.path.join(partial, f"rng_rank{rank:05d}.safetensors"))
    gathered = [records]
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, records)
    _barrier()
    if rank == 0:
        _write_metadata(partial, gathered, iteration=iteration, state=state, true_vocab_size=true_vocab_size,
                        consumed_samples=consumed_samples, scheduler=scheduler, run_config=run_config,
                        layout_extra=layout_extra or {})
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(partial, final)
        _fsync_write(os.path.join(directory, LATEST), str(iteration).encode())
    _barrier()
    return final


def _save_model_shards(folder: str, chunks, config, state) -> dict:
    """Writes this rank's model shards if it is dp rank 0; returns ``{name: record}``."""
    if state.dp_rank != 0 or state.cp_rank != 0:
        return {}
    file = f"model_tp{state.tp_rank:02d}_pp{state.pp_rank:03d}.safetensors"
    named = global_named_parameters(chunks, config, state)
    save_file({name: p.detach().cpu().contiguous() for name, p in named.items()}, os.path.join(folder, file))
    records = {}
    for name, param in named.items():
        dim, stride = partition_record(param)
        records[name] = {"file": file, "tp_rank": state.tp_rank, "local_shape": list(param.shape),
                         "partition_dim": dim, "stride": stride, "dtype": str(param.dtype)}
    return records


def _write_metadata(folder: str, gathered: list[dict], **info) -> None:
    tensors: dict[str, dict] = {}
    for records in gathered:
        for name, record in records.items():
            entry = tensors.setdefault(name, {"partition_dim": record["partition_dim"], "stride": record["stride"],
                                              "dtype": record["dtype"], "shards": {}})
            entry["shards"][str(record["tp_rank"])] = {"file": record["file"], "shape": record["local_shape"]}
    for entry in tensors.values():
        shapes = [s["shape"] for _, s in sorted(entry["shards"].items(), key=lambda kv: int(kv[0]))]
        dim = entry["partition_dim"]
        entry["global_shape"] = list(shapes[0]) if dim is None else [
            sum(s[d] for s in shapes) if d == dim else shapes[0][d] for d in range(len(shapes[0]))]
    state, scheduler = info["state"], info["scheduler"]
    metadata = {
        "format": "megatron_core/1", "iteration": info["iteration"], "consumed_samples": info["consumed_samples"],
        "true_vocab_size": info["true_vocab_size"], "layout": _layout(state, info["layout_extra"]),
        "config": info["run_config"] or {}, "scheduler": scheduler.state_dict() if scheduler else None,
        "tensors": tensors,
        "checksums": {f: _sha256(os.path.join(folder, f)) for f in sorted(os.listdir(folder))},
    }
    _fsync_write(os.path.join(folder, "metadata.json"), json.dumps(metadata, indent=1).encode())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_tensors(device: torch.device) -> dict[str, torch.Tensor]:
    tensors = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":  # CUDA-only path
        tensors["cuda"] = torch.cuda.get_rng_state(device)
    tensors.update({f"tracker/{name}": t for name, t in get_rng_tracker(device).get_states().items()})
    return tensors


def latest_iteration(directory: str) -> Optional[int]:
    path = os.path.join(directory, LATEST)
    if not os.path.exists(path):
        return None
    text = open(path, encoding="utf-8").read().strip()
    if not text.isdigit():
        raise ValueError(f"{path} does not hold an iteration number (got {text[:40]!r})")
    return int(text)


def read_metadata(directory: str, iteration: Optional[int] = None) -> tuple[str, dict]:
    """``(checkpoint folder, metadata)`` of ``iteration`` (default: the newest complete one)."""
    iteration = latest_iteration(directory) if iteration is None else iteration
    if iteration is None:
        raise ValueError(f"no checkpoint in {directory}: {LATEST} is missing")
    folder = os.path.join(directory, f"iter_{iteration:07d}")
    path = os.path.join(folder, "metadata.json")
    if not os.path.exists(path):
        raise ValueError(f"checkpoint {folder} is incomplete: metadata.json is missing")
    with open(path, encoding="utf-8") as f:
        return folder, json.load(f)


def _verify(folder: str, metadata: dict, files: set[str]) -> None:
    for file in sorted(files):
        path = os.path.join(folder, file)
        expected = metadata["checksums"].get(file)
        if not os.path.exists(path):
            raise ValueError(f"checkpoint file {path} is missing")
        if expected is not None and _sha256(path) != expected:
            raise ValueError(f"checkpoint file {path} is corrupt: its sha256 does not match metadata.json")


def load_model_weights(folder: str, metadata: dict, *, model_chunks: Sequence[nn.Module], config: TransformerConfig,
                       state: ParallelState) -> None:
    """Copies every local parameter from the checkpoint, merging and re-splitting tp shards as needed."""
    named = global_named_parameters(model_chunks, config, state)
    tensors = metadata["tensors"]
    needed = {s["file"] for name in named for s in tensors.get(_source_name(name, tensors), {}).get("shards", {}).values()}
    _verify(folder, metadata, needed)
    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(safe_open(os.path.join(folder, file), framework="pt")) for file in needed}
        for name, param in named.items():
            _load_parameter(name, param, handles, folder, metadata, state)


def _load_parameter(name: str, param: nn.Parameter, handles: dict, folder: str, metadata: dict,
                    state: ParallelState) -> None:
    tensors = metadata["tensors"]
    source = _source_name(name, tensors)
    if source not in tensors:
        raise ValueError(f"checkpoint {folder} has no tensor {name!r} (was it written for another model shape?)")
    entry = tensors[source]
    shards = [handles[s["file"]].get_tensor(source) for _, s in sorted(entry["shards"].items(), key=lambda kv: int(kv[0]))]
    full = merge_shards(shards, entry["partition_dim"], entry["stride"])
    if name in VOCAB_PARAMS:  # padded to a multiple that depends on tp: re-pad from the true vocab
        full = repad_vocab(full, metadata["true_vocab_size"], param.shape[0] * state.tp_size)
    dim, stride = partition_record(param)
    shard = take_shard(full, dim, stride, state.tp_rank, state.tp_size)
    if tuple(shard.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(full.shape)} (shard {tuple(shard.shape)}) "
                         f"but the model expects a shard of {tuple(param.shape)}: another model shape?")
    with torch.no_grad():
        param.copy_(shard.to(param.dtype))


def _source_name(name: str, tensors: dict) -> str:
    """A tied output layer saved without its own copy (pipeline size 1) loads from the word embedding."""
    if name == "output_layer.weight" and name not in tensors:
        return "embedding.word_embeddings.weight"
    return name


def load_optimizer_and_rng(folder: str, metadata: dict, *, state: ParallelState, optimizer: Optional[Any],
                           load_rng: bool, layout_extra: Optional[dict] = None) -> None:
    """Restores this rank's optimizer and RNG states (the same layout only)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    layout = _layout(state, layout_extra or {})
    if optimizer is not None:
        if metadata["layout"] != layout:
            raise ValueError(f"optimizer states were saved at layout {metadata['layout']} and cannot be loaded at "
                             f"{layout} yet; pass --no-load-optim to load the weights only")
        files = {f"optim_rank{rank:05d}.safetensors", f"optim_rank{rank:05d}.json"}
        _verify(folder, metadata, files)
        with safe_open(os.path.join(folder, f"optim_rank{rank:05d}.safetensors"), framework="pt") as handle:
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        skeleton = json.load(open(os.path.join(folder, f"optim_rank{rank:05d}.json"), encoding="utf-8"))
        optimizer.load_state_dict(unflatten_state(skeleton, tensors))
    if load_rng and metadata["layout"] == layout:
        file = f"rng_rank{rank:05d}.safetensors"
        _verify(folder, metadata, {file})
        with safe_open(os.path.join(folder, file), framework="pt") as handle:
            torch.set_rng_state(handle.get_tensor("cpu"))
            if state.device.type == "cuda" and "cuda" in handle.keys():  # CUDA-only path
                torch.cuda.set_rng_state(handle.get_tensor("cuda"), state.device)
            tracker = {k.split("/", 1)[1]: handle.get_tensor(k) for k in handle.keys() if k.startswith("tracker/")}
            if tracker:
                get_rng_tracker(state.device).set_states(tracker)
