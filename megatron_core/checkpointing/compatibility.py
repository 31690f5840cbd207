"""Strict loading: the checkpoint's tensors must be exactly the model's, at the model's shapes.

``tensor_mismatches`` compares the model tensors of a checkpoint's ``metadata.json`` with the model's global
names and global shapes gathered from every rank (one ``all_gather_object``, so every rank reaches the same
verdict before anything is read and no rank is left waiting in a collective): tensors the checkpoint lacks,
tensors it has that the model does not (optimizer states ``optim/...`` aside), and tensors of another shape
(vocab rows compared through the true vocab size, since the padding depends on tp). A strict load refuses
any of them, listing them all; ``--finetune --ignore-mismatched-sizes`` loads what fits and lists the rest.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch.distributed as dist
from torch import nn

from megatron_core.checkpointing.layout import partition_record
from megatron_core.checkpointing.shard_reader import VOCAB_PARAMS

OPTIM_PREFIX = "optim/"


@dataclasses.dataclass(frozen=True)
class TensorMismatches:
    """Global names: ``missing`` from the checkpoint, ``extra`` in it, ``reshaped`` -> (checkpoint, model)."""

    missing: tuple[str, ...]
    extra: tuple[str, ...]
    reshaped: dict

    def __bool__(self) -> bool:
        return bool(self.missing or self.extra or self.reshaped)

    def describe(self, folder: str, limit: int = 8) -> str:
        parts = []
        for label, names in (("missing from it", self.missing), ("in it but not in the model", self.extra)):
            if names:
                shown = ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
                parts.append(f"{len(names)} tensor(s) {label}: {shown}")
        if self.reshaped:
            items = sorted(self.reshaped.items())
            shown = ", ".join(f"{n} {tuple(a)} in the checkpoint vs {tuple(b)} in the model" for n, (a, b) in
                              items[:limit])
            parts.append(f"{len(items)} tensor(s) of another shape: {shown}"
                         + (f" and {len(items) - limit} more" if len(items) > limit else ""))
        return f"checkpoint {folder} does not match the model: " + "; ".join(parts)


def model_global_shapes(named: dict[str, nn.Parameter], tp_size: int, *,
                        etp_size: int = 1) -> dict[str, tuple[int, ...]]:
    """``{global name: global shape}`` of this rank's tensors (a split dim times ``tp_size``, or ``etp_size`` for
    an MoE expert's tensor: experts are split over the expert tensor-parallel group)."""
    shapes = {}
    for name, tensor in named.items():
        dim, _ = partition_record(tensor)
        shape = list(tensor.shape)
        if dim is not None:
            shape[dim] *= etp_size if getattr(tensor, "is_expert", False) else tp_size
        shapes[name] = tuple(shape)
    return shapes


def tensor_mismatches(metadata: dict, local_shapes: dict[str, tuple[int, ...]], *, optional: set[str] = frozenset(),
                      tied_output: bool, true_vocab_size: int) -> TensorMismatches:
    """Collective over every rank: the model's shapes from all ranks against the checkpoint's records.
    ``optional``: names that may be absent from the checkpoint (buffers older checkpoints did not save)."""
    gathered: Sequence[tuple] = [(local_shapes, set(optional))]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (local_shapes, set(optional)))
    model: dict[str, tuple[int, ...]] = {}
    may_lack: set[str] = set()
    for shapes, names in gathered:
        model.update(shapes)
        may_lack |= names
    saved = {n: e for n, e in metadata["tensors"].items() if not n.startswith(OPTIM_PREFIX)}
    missing = []
    for name in sorted(model):
        if name in saved or name in may_lack:
            continue
        tied_alias = name.endswith("output_layer.weight") and \
            name[: -len("output_layer.weight")] + "embedding.word_embeddings.weight" in saved
        if not tied_alias:  # a tied output layer saved without its own copy loads from the embedding
            missing.append(name)
    extra = [n for n in sorted(saved) if n not in model
             and not (tied_output and n.endswith("output_layer.weight"))]
    reshaped = {}
    for name in sorted(set(model) & set(saved)):
        ours, theirs = list(model[name]), list(saved[name]["global_shape"])
        if name.endswith(VOCAB_PARAMS) and ours and theirs:  # padding differs by tp: compare the true vocab
            ours[0] = true_vocab_size
            theirs[0] = metadata["true_vocab_size"]
        if ours != theirs:
            reshaped[name] = (tuple(theirs), tuple(ours))
    return TensorMismatches(missing=tuple(missing), extra=tuple(extra), reshaped=reshaped)


__all__ = ["TensorMismatches", "model_global_shapes", "tensor_mismatches"]
