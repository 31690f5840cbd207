"""Small helpers shared by the tensor-parallel layers: group queries, divisibility, vocab ranges and padding."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """World size of ``group``; 1 for None (no parallelism on this axis)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    """This process's rank inside ``group``; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


def divide(numerator: int, denominator: int, *, what: str = "value", by: str = "tensor_model_parallel_size") -> int:
    """``numerator // denominator``, raising ValueError naming both values when it does not divide."""
    if numerator % denominator != 0:
        raise ValueError(
            f"{what} {numerator} is not divisible by {by} {denominator}; choose sizes whose ratio is whole"
        )
    return numerator // denominator


def vocab_size_with_padding(
    orig_vocab_size: int, *, make_vocab_size_divisible_by: int = 128, tensor_model_parallel_size: int = 1
) -> int:
    """Megatron's padded vocab: the smallest multiple of ``make_vocab_size_divisible_by * tp`` >= the vocab.

    Padding keeps each tp shard of the embedding and output layer the same size (and GEMM-friendly).
    The true vocab size must be stored beside any checkpoint, since the padding depends on tp.
    """
    if orig_vocab_size < 1 or make_vocab_size_divisible_by < 1 or tensor_model_parallel_size < 1:
        raise ValueError(
            f"vocab padding needs positive sizes, got orig_vocab_size={orig_vocab_size}, "
            f"make_vocab_size_divisible_by={make_vocab_size_divisible_by}, "
            f"tensor_model_parallel_size={tensor_model_parallel_size}"
        )
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-orig_vocab_size // multiple) * multiple


def vocab_range(global_vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """``[start, end)`` of the vocab entries held by ``tp_rank`` (the vocab is split evenly, in order)."""
    per_partition = divide(global_vocab_size, tp_size, what="vocab size (padded)")
    start = tp_rank * per_partition
    return start, start + per_partition


def check_ids_in_range(ids: torch.Tensor, upper: int, what: str) -> None:
    """Raises when any of ``ids`` lies outside ``[0, upper)``; never a silent zero embedding or loss.

    On CPU the check is immediate and raises ValueError with the offending values. On an accelerator it is
    an asynchronous device assert (no host sync on the hot path) that fails the next synchronizing call.
    """
    if ids.device.type == "cpu":
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= upper):
            raise ValueError(
                f"{what} must lie in [0, {upper}), got values in [{int(ids.min())}, {int(ids.max())}]; "
                f"check the tokenizer's vocab size against the model's (padded) vocab size"
            )
        return
    torch._assert_async(((ids >= 0) & (ids < upper)).all(), f"{what} out of range [0, {upper})")
