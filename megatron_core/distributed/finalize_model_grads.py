"""Gradient reductions that model parallelism needs after backward (before any data-parallel reduction).

- Sequence parallelism: replicated parameters used inside sequence-parallel regions (norm weights, the
  row-parallel biases) receive a partial grad on each tp rank; they carry ``sequence_parallel = True`` and
  their grads are all-reduced over tp.
- Tied embeddings across pipeline stages: the word embedding (first stage) and the output layer's copy of it
  (last stage) carry ``shared_embedding = True``; their grads are all-reduced over the embedding group so
  both copies take the same optimizer step. With multi-token prediction the last stage holds a copy of the
  whole embedding (word and position embeddings, tied or not): each end then marks the same tensors, in the
  same order.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron_core.parallel_state import ParallelState
from megatron_core.tensor_parallel.utils import group_size


def _grad_of(param: nn.Parameter) -> Optional[torch.Tensor]:
    """The gradient buffer a reduction acts on (``main_grad`` when a data-parallel wrapper keeps one)."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def _all_reduce_coalesced(grads: list[torch.Tensor], group) -> None:
    """Sums ``grads`` over ``group`` with one all-reduce per dtype, written back in place."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same_dtype in by_dtype.values():
        flat = _flatten_dense_tensors(same_dtype)
        dist.all_reduce(flat, group=group)
        for grad, reduced in zip(same_dtype, _unflatten_dense_tensors(flat, same_dtype)):
            grad.copy_(reduced)


def _tagged_grads(models: Iterable[nn.Module], attribute: str) -> list[torch.Tensor]:
    grads = []
    for model in models:
        for param in model.parameters():
            grad = _grad_of(param)
            if getattr(param, attribute, False) and grad is not None:
                grads.append(grad)
    return grads


def allreduce_sequence_parallel_grads(models: Sequence[nn.Module], state: ParallelState) -> None:
    """All-reduce over tp of the grads of parameters tagged ``sequence_parallel``."""
    if group_size(state.tp_group) > 1:
        grads = _tagged_grads(models, "sequence_parallel")
        if grads:
            _all_reduce_coalesced(grads, state.tp_group)


UNTIED_MARK = "_embedding_group_agreed_untied"
"""Set on model chunks once both ends of the pipeline agreed that none of their parameters is tied: later
steps then skip the check (a collective that made the last stage wait for the first stage's last backward)."""


def allreduce_embedding_grads(models: Sequence[nn.Module], state: ParallelState) -> None:
    """All-reduce over the embedding group (first + last stage) of the grads tagged ``shared_embedding``."""
    if state.embedding_group is None or group_size(state.embedding_group) == 1:
        return
    if models and all(getattr(model, UNTIED_MARK, False) for model in models):
        return
    tagged = sum(getattr(p, "shared_embedding", False) for model in models for p in model.parameters())
    grads = _tagged_grads(models, "shared_embedding")
    numel = sum(grad.numel() for grad in grads)
    # Both ends must agree on the shared tensors before the (large) reduction: a scalar check turns a
    # disagreement into the same ValueError on both ranks instead of one rank waiting forever.
    counts = torch.tensor([len(grads), -len(grads), tagged, numel, -numel], dtype=torch.float64, device=state.device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=state.embedding_group)
    most, fewest = int(counts[0]), -int(counts[1])
    if int(counts[2]) == 0:  # no tied parameter on either end: the same on every later step
        for model in models:
            setattr(model, UNTIED_MARK, True)
    if most == 0:
        return
    if most != fewest or int(counts[3]) != -int(counts[4]):
        raise ValueError(f"each shared embedding tensor must appear once on each end of the pipeline, found between "
                         f"{fewest} and {most} tensors (rank {state.rank} has {len(grads)} of {numel} elements): "
                         "pre_process/post_process, share_embeddings_and_output_weights or mtp_num_layers "
                         "disagree between the first and last stage")
    _all_reduce_coalesced(grads, state.embedding_group)


def finalize_model_grads(models: Union[nn.Module, Sequence[nn.Module]], state: ParallelState) -> None:
    """Finishes each chunk's data-parallel grad reduction (``finish_grad_sync()``, when the chunk is wrapped
    by a data-parallel module that has it), then runs both reductions above. Every rank must call it."""
    models = [models] if isinstance(models, nn.Module) else list(models)
    for model in models:
        if hasattr(model, "finish_grad_sync"):
            model.finish_grad_sync()
    allreduce_sequence_parallel_grads(models, state)
    allreduce_embedding_grads(models, state)
