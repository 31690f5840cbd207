"""Offline checkpoint conversion between tp/pp/dp layouts, one tensor at a time (no process group).

A *source* is any checkpoint seen as a list of full tensors under global names, each with its tp partition
record and a function that reads it (``read_mcore_checkpoint`` here, ``hf_gpt2.read_hf_gpt2`` for Hugging
Face). ``write_mcore_checkpoint`` re-splits every tensor for the target tp, assigns it to the pipeline stage
that owns it and streams it into ``model_tp{r}_pp{p}.safetensors`` (header first, then tensor by tensor), so
peak memory stays near the largest tensor. Optimizer states (``optim/<state>/<param>``) are converted like
their parameters; vocab-padded tensors (names ending in a ``VOCAB_PARAMS`` entry) lose their padding on read
and are re-padded for the target tp on write. MoE experts (``...mlp.experts.local_experts.<global id>...``
and their optimizer states) go, once, into ``experts_ep{r}_pp{p}.safetensors`` of the target ep rank that
holds its global id (ep rank r holds ids ``[r * E / ep, (r + 1) * E / ep)``), or with expert tensor
parallelism (etp > 1, any size: the expert grid is independent of tp) split as the model splits them
(``expert_partition``) into ``experts_ep{r}_tp{t}_pp{p}.safetensors`` (t the etp rank), so conversion changes tp,
pp, ep and etp together and every expert keeps its global id.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Any, Callable, Optional

import torch

from megatron_core.checkpointing.checkpoint import LATEST, fsync_write, read_metadata
from megatron_core.checkpointing.durable import remove_path
from megatron_core.checkpointing.layout import merge_shards, repad_vocab, take_shard
from megatron_core.checkpointing.publication import publish_checkpoint
from megatron_core.checkpointing.shard_reader import (
    VOCAB_PARAMS,
    open_safetensors,
    safe_path,
    verify_files,
)
from megatron_core.checkpointing.streaming import StreamingSafetensorsWriter, parse_dtype
from megatron_core.config import TransformerConfig
from megatron_core.tensor_parallel import vocab_size_with_padding
from megatron_core.utils.progress import progress_bar

FORMAT = "megatron_core/1"
OPTIM_PREFIX = "optim/"


def parameter_name(name: str) -> str:
    """The parameter a tensor belongs to: ``optim/exp_avg/decoder.layers.0.x`` -> ``decoder.layers.0.x``."""
    return name.split("/", 2)[2] if name.startswith(OPTIM_PREFIX) else name


def is_vocab_tensor(name: str) -> bool:
    return parameter_name(name).endswith(VOCAB_PARAMS)


@dataclasses.dataclass
class SourceTensor:
    """One full tensor of a source checkpoint (vocab padding removed), read on demand by ``load()``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    partition_dim: Optional[int]
    stride: int
    load: Callable[[], torch.Tensor]


@dataclasses.dataclass
class SourceCheckpoint:
    """A checkpoint as full tensors plus what metadata.json records besides them."""

    description: str
    tensors: list[SourceTensor]
    true_vocab_size: int
    flags: dict
    iteration: int = 0
    consumed_samples: int = 0
    scheduler: Optional[dict] = None
    optimizer: Any = None
    layout: dict = dataclasses.field(default_factory=dict)


def read_mcore_checkpoint(load_dir: str, iteration: Optional[int] = None, *,
                          require_checksums: bool = True) -> SourceCheckpoint:
    """The newest (or given) checkpoint of ``load_dir`` as a ``SourceCheckpoint``; nothing is read yet
    but metadata.json. Raises ValueError naming the file and tensor for a missing or mismatched shard (and,
    with ``require_checksums``, for a file metadata.json records no sha256 for)."""
    folder, metadata = read_metadata(load_dir, iteration)
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{folder}/metadata.json has format {metadata.get('format')!r}, expected {FORMAT!r}")
    reader = _ShardReader(folder, metadata, require_checksums=require_checksums)
    tensors = [reader.source_tensor(name, entry) for name, entry in metadata["tensors"].items()]
    return SourceCheckpoint(description=folder, tensors=tensors, true_vocab_size=metadata["true_vocab_size"],
                            flags=dict(metadata.get("config") or {}), iteration=metadata.get("iteration", 0),
                            consumed_samples=metadata.get("consumed_samples", 0),
                            scheduler=metadata.get("scheduler"), optimizer=metadata.get("optimizer"),
                            layout=dict(metadata.get("layout") or {}))


class _ShardReader:
    """Reads and merges the tp shards of one tensor at a time (etp shards for a routed expert's), verifying each
    file's sha256 once."""

    def __init__(self, folder: str, metadata: dict, *, require_checksums: bool = True) -> None:
        self.folder, self.metadata, self.verified = folder, metadata, set()
        self.require_checksums = require_checksums
        self.tp = int(metadata.get("layout", {}).get("tp", 1))
        self.etp = int((metadata.get("config") or {}).get("expert_tensor_parallel_size") or 1)

    def source_tensor(self, name: str, entry: dict) -> SourceTensor:
        ranks = {int(r) for r in entry["shards"]}
        axis, size = ("etp", self.etp) if expert_id_of(name) is not None else ("tp", self.tp)
        needed = {0} if entry["partition_dim"] is None else set(range(size))
        if not needed <= ranks:
            raise ValueError(f"checkpoint {self.folder}: tensor {name!r} has no shard for {axis} rank(s) "
                             f"{sorted(needed - ranks)} in metadata.json (layout {axis} {size})")
        shape = list(entry["global_shape"])
        if is_vocab_tensor(name):
            shape[0] = self.metadata["true_vocab_size"]
        return SourceTensor(name=name, shape=tuple(shape), dtype=parse_dtype(entry["dtype"]),
                            partition_dim=entry["partition_dim"], stride=entry["stride"],
                            load=lambda: self.load(name, entry, sorted(needed)))

    def _read_shard(self, name: str, shard: dict) -> torch.Tensor:
        file = shard["file"]
        path = safe_path(self.folder, file)
        if not os.path.exists(path):
            raise ValueError(f"checkpoint file {path} (shard of tensor {name!r}) is missing")
        if file not in self.verified:
            verify_files(self.folder, self.metadata, {file}, require_checksums=self.require_checksums)
            self.verified.add(file)
        with open_safetensors(path) as handle:
            if name not in handle.keys():
                raise ValueError(f"checkpoint file {path} has no tensor {name!r} although metadata.json says so")
            tensor = handle.get_tensor(name)
        if list(tensor.shape) != list(shard["shape"]):
            raise ValueError(f"checkpoint file {path}: tensor {name!r} has shape {list(tensor.shape)} but "
                             f"metadata.json records {shard['shape']}")
        return tensor

    def load(self, name: str, entry: dict, ranks: list[int]) -> torch.Tensor:
        shards = [self._read_shard(name, entry["shards"][str(r)]) for r in ranks]
        full = merge_shards(shards, entry["partition_dim"], entry["stride"])
        if list(full.shape) != list(entry["global_shape"]):
            raise ValueError(f"checkpoint {self.folder}: the shards of tensor {name!r} merge to {list(full.shape)}, "
                             f"not the global shape {entry['global_shape']} of metadata.json")
        return full[: self.metadata["true_vocab_size"]] if is_vocab_tensor(name) else full


EXPERT_MARK = ".mlp.experts.local_experts."


def expert_id_of(name: str) -> Optional[int]:
    """The global expert id of a routed-expert tensor (or its optimizer state), else None."""
    param = parameter_name(name)
    if EXPERT_MARK not in param:
        return None
    return int(param.split(EXPERT_MARK, 1)[1].split(".", 1)[0])


def expert_partition(name: str, *, swiglu: bool) -> tuple[Optional[int], int]:
    """``(partition_dim, stride)`` of a routed-expert tensor split over etp, as ``moe.experts`` splits it:
    fc1 by rows (SwiGLU's gate and up halves each: stride 2), fc2 by columns (its bias replicated)."""
    param = parameter_name(name)
    if ".linear_fc1." in param:
        return 0, 2 if swiglu else 1
    if param.endswith(".linear_fc2.weight"):
        return 1, 1
    return None, 1


def pipeline_stage_of(name: str, config: TransformerConfig) -> int:
    """The pipeline rank that holds tensor ``name`` in a model built with ``config``."""
    param = parameter_name(name)
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    if param.startswith("embedding."):
        return 0
    if param.startswith(("decoder.final_layernorm.", "output_layer.", "mtp.")):  # MTP sits on the last stage
        return pp - 1
    if param.startswith("decoder.layers."):
        layer = int(param.split(".")[2])
        for rank in range(pp):
            for vp in range(vpp or 1):
                offset, count = config.pipeline_layer_range(rank, vp if vpp else None)
                if offset <= layer < offset + count:
                    return rank
        raise ValueError(f"tensor {name!r} names layer {layer} but the model has {config.num_layers} layers")
    raise ValueError(f"tensor {name!r} is not a GPT parameter this converter knows (embedding.*, decoder.*, "
                     "output_layer.*, mtp.*, optionally under optim/<state>/)")


def plan_target_tensors(source: SourceCheckpoint, *, tied: bool, pp: int,
                        no_optim: bool) -> list[tuple[str, SourceTensor]]:
    """``[(target name, source tensor)]``: drops optimizer states with ``no_optim``; a tied output layer is
    stored as a copy of the word embedding only when pp > 1 (the last stage holds it)."""
    names = {t.name for t in source.tensors}
    plan = []
    for tensor in source.tensors:
        if no_optim and tensor.name.startswith(OPTIM_PREFIX):
            continue
        if tied and pp == 1 and parameter_name(tensor.name) == "output_layer.weight":
            continue
        plan.append((tensor.name, tensor))
        if tied and pp > 1 and parameter_name(tensor.name) == "embedding.word_embeddings.weight":
            copy = tensor.name[: -len("embedding.word_embeddings.weight")] + "output_layer.weight"
            if copy not in names:
                plan.append((copy, tensor))
    return plan


@dataclasses.dataclass
class PlannedTensor:
    """One target tensor: its source, pipeline stage and split (``splits`` shards along ``partition_dim``: tp
    for dense tensors, etp for experts; a tensor not split is stored whole, once per tp file or once)."""

    name: str
    source: SourceTensor
    stage: int
    partition_dim: Optional[int]
    stride: int
    splits: int
    expert: Optional[int]

    def shard_shape(self, padded_vocab: int) -> tuple[int, ...]:
        shape = list(self.source.shape)
        if is_vocab_tensor(self.name):
            shape[0] = padded_vocab
        dim, size = self.partition_dim, self.splits
        if dim is not None and shape[dim] % (self.stride * size) != 0:
            axis = "expert_tensor_parallel_size" if self.expert is not None else "tensor_model_parallel_size"
            raise ValueError(f"tensor {self.name!r} of shape {tuple(shape)} cannot be split over {axis} {size} "
                             f"(dim {dim} with stride {self.stride})")
        if dim is not None:
            shape[dim] //= size
        return tuple(shape)


def plan_tensor(name: str, tensor: SourceTensor, config: TransformerConfig, etp: int) -> PlannedTensor:
    expert = expert_id_of(name)
    if expert is None:
        dim, stride, splits = tensor.partition_dim, tensor.stride, config.tensor_model_parallel_size
    else:
        dim, stride = expert_partition(name, swiglu=config.gated_activation) if etp > 1 else (None, 1)
        splits = etp
    return PlannedTensor(name, tensor, pipeline_stage_of(name, config), dim, stride, splits, expert)


def write_mcore_checkpoint(source: SourceCheckpoint, save_dir: str, *, config: TransformerConfig, flags: dict,
                           data_parallel_size: int = 1, no_optim: bool = False, progress: bool = True,
                           expert_parallel_size: int = 1, expert_tensor_parallel_size: int = 1) -> str:
    """Writes ``source`` as a checkpoint for the layout of ``config`` (its tp and pp sizes) under
    ``save_dir/iter_N`` (atomically: ``iter_N.partial``, fsync, rename, then the pointer file).

    Args:
        config: the target model config (validated: heads, groups, ffn divisible by tp, layers by pp).
        flags: the run flags metadata.json records as ``config`` (already set for the target layout).
        data_parallel_size: recorded as the layout's dp (dp sharding happens at load time).
        no_optim: drop optimizer states (``optim/`` tensors and metadata["optimizer"]).
        expert_parallel_size: the target ep (MoE models: ``num_moe_experts`` must be divisible by it).
        expert_tensor_parallel_size: the target etp (1: whole experts; more: each expert split over etp ranks,
            which need not be the tp ranks; the expert hidden size must divide by it).
    Returns: the checkpoint folder.
    """
    if data_parallel_size < 1:
        raise ValueError(f"target data-parallel size must be >= 1, got {data_parallel_size}")
    tp, pp, ep = config.tensor_model_parallel_size, config.pipeline_model_parallel_size, expert_parallel_size
    num_experts = config.moe.num_moe_experts if config.moe is not None else None
    if ep < 1 or (ep > 1 and num_experts is None) or (num_experts and num_experts % ep):
        raise ValueError(f"target expert_model_parallel_size {ep} does not fit num_moe_experts {num_experts} "
                         "(it must be >= 1 and divide the number of experts; 1 without experts)")
    etp = expert_tensor_parallel_size
    if etp < 1 or (etp > 1 and num_experts is None):
        raise ValueError(f"target expert_tensor_parallel_size {etp} must be >= 1 (and 1 without experts)")
    expert_ffn = (config.moe.moe_ffn_hidden_size or config.ffn_hidden_size) if num_experts else 1
    if expert_ffn % etp:  # checked before any folder is made: a failed conversion leaves nothing behind
        raise ValueError(f"expert hidden size {expert_ffn} cannot be split over expert_tensor_parallel_size {etp}: "
                         "choose a target expert tensor parallel size that divides it")
    padded_vocab = vocab_size_with_padding(
        source.true_vocab_size, tensor_model_parallel_size=tp,
        make_vocab_size_divisible_by=int(flags.get("make_vocab_size_divisible_by", 128)))
    tied = not (flags.get("untie_embeddings_and_output_weights") or config.untie_embeddings_and_output_weights)
    plan = [plan_tensor(name, tensor, config, etp)
            for name, tensor in plan_target_tensors(source, tied=tied, pp=pp, no_optim=no_optim)]
    final = os.path.join(save_dir, f"iter_{source.iteration:07d}")
    partial = f"{final}.partial"
    os.makedirs(save_dir, exist_ok=True)
    remove_path(partial)
    os.mkdir(partial)
    records, digests = _stream_tensors(partial, plan, padded_vocab=padded_vocab,
                              true_vocab=source.true_vocab_size, progress=progress,
                              experts_per_rank=(num_experts // ep) if num_experts else None)
    layout = {"tp": tp, "pp": pp, "dp": data_parallel_size, "vpp": config.virtual_pipeline_model_parallel_size,
              **({"ep": ep} if ep > 1 else {}),
              "zero_stage": source.layout.get("zero_stage", flags.get("zero_stage", 0))}
    metadata = {"format": FORMAT, "iteration": source.iteration, "consumed_samples": source.consumed_samples,
                "true_vocab_size": source.true_vocab_size, "layout": layout, "config": flags,
                "scheduler": source.scheduler, "optimizer": None if no_optim else source.optimizer,
                "tensors": records, **digests}
    fsync_write(os.path.join(partial, "metadata.json"), json.dumps(metadata, indent=1).encode())
    publish_checkpoint(directory=save_dir, partial=partial, final=final, iteration=source.iteration,
                       expected_files=metadata["checksums"], pointer=LATEST)
    return final


def _shard_file(planned: PlannedTensor, rank: int, experts_per_rank: Optional[int]) -> str:
    if planned.expert is None:
        return f"model_tp{rank:02d}_pp{planned.stage:03d}.safetensors"
    if experts_per_rank is None:
        raise ValueError(f"tensor {planned.name!r} is a routed expert's but the target model has no experts")
    tp_part = f"_tp{rank:02d}" if planned.splits > 1 else ""
    return f"experts_ep{planned.expert // experts_per_rank:03d}{tp_part}_pp{planned.stage:03d}.safetensors"


def _stream_tensors(folder: str, plan: list[PlannedTensor], *, padded_vocab: int, true_vocab: int,
                    progress: bool, experts_per_rank: Optional[int] = None) -> tuple[dict, dict]:
    """Declares every file's tensors, then reads each source tensor once and writes its shards (a dense tensor
    into each tp file; an expert tensor into its ep rank's expert file, or its etp shards into theirs).
    Returns ``(records, {"checksums": {file: sha256}, "sizes": {file: bytes}})`` (hashed while written)."""
    declared: dict[str, list] = {}
    records = {}
    for planned in plan:
        shard_shape, shards = planned.shard_shape(padded_vocab), {}
        for rank in range(planned.splits):
            file = _shard_file(planned, rank, experts_per_rank)
            declared.setdefault(file, []).append((planned.name, planned.source.dtype, shard_shape))
            shards[str(rank)] = {"file": file, "shape": list(shard_shape)}
        global_shape = [padded_vocab if is_vocab_tensor(planned.name) and d == 0 else n
                        for d, n in enumerate(planned.source.shape)]
        records[planned.name] = {"partition_dim": planned.partition_dim, "stride": planned.stride,
                                 "dtype": str(planned.source.dtype), "shards": shards, "global_shape": global_shape}
    with contextlib.ExitStack() as stack:
        writers = {file: StreamingSafetensorsWriter(os.path.join(folder, file), tensors, atomic=False)
                   for file, tensors in declared.items()}
        for writer in writers.values():
            stack.callback(writer._file.close)
        for planned in progress_bar(plan, desc="converting", unit=" tensors", enabled=progress):
            name, tensor = planned.name, planned.source
            full = tensor.load()
            if tuple(full.shape) != tensor.shape:
                raise ValueError(f"{name!r}: read shape {tuple(full.shape)}, expected {tensor.shape}")
            if is_vocab_tensor(name):
                full = repad_vocab(full, true_vocab, padded_vocab)
            for rank, shard_record in records[name]["shards"].items():
                shard = take_shard(full, planned.partition_dim, planned.stride, int(rank), planned.splits)
                writers[shard_record["file"]].write(name, shard.to(tensor.dtype))
        for writer in writers.values():
            writer.close()
    files = sorted(writers)
    return records, {"checksums": {f: writers[f].sha256 for f in files}, "sizes": {f: writers[f].size for f in files}}


__all__ = ["SourceTensor", "SourceCheckpoint", "read_mcore_checkpoint", "write_mcore_checkpoint",
           "plan_target_tensors", "pipeline_stage_of", "expert_id_of", "expert_partition", "parameter_name",
           "is_vocab_tensor", "VOCAB_PARAMS"]
