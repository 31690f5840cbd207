"""The load-balanced causal split of a sequence over the cp ranks (Megatron-LM's ``get_batch_on_this_cp_rank``).

The sequence of length ``s`` is cut into ``2 * cp`` chunks of ``c = s / (2 cp)`` tokens, and cp rank ``r``
holds chunks ``r`` and ``2 cp - 1 - r`` (in that order). With a causal mask every rank then does the same
attention work: an early chunk (little to look at) paired with a late one (much to look at). Example, s 16
and cp 2 (chunks of 4 tokens)::

    rank 0: positions  0  1  2  3 | 12 13 14 15      (chunks 0 and 3)
    rank 1: positions  4  5  6  7 |  8  9 10 11      (chunks 1 and 2)

"Rank-chunk order" is the concatenation of every rank's tokens in rank order (what an all-gather over cp
returns): chunks ``0, 2cp-1, 1, 2cp-2, ...``. Everything here is pure indexing; no communication.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch


def check_sequence_split(seq_length: int, cp_size: int, cp_rank: int = 0) -> None:
    """Raises ValueError unless ``seq_length`` splits into ``2 * cp_size`` equal chunks and ``cp_rank`` is valid."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is not in [0, context_parallel_size {cp_size})")
    if seq_length < 1 or seq_length % (2 * cp_size) != 0:
        raise ValueError(f"sequence length {seq_length} is not divisible by 2 x context_parallel_size {cp_size} = "
                         f"{2 * cp_size}: the load-balanced causal split cuts the sequence into {2 * cp_size} equal "
                         "chunks; change --seq-length (or pad the sequence) or the context-parallel size")


def chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks cp rank ``cp_rank`` holds: ``(cp_rank, 2 * cp_size - 1 - cp_rank)``."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def local_positions(seq_length: int, *, cp_size: int, cp_rank: int,
                    device: Optional[torch.device] = None) -> torch.Tensor:
    """Global positions ``[s / cp]`` (int64) of the tokens cp rank ``cp_rank`` holds, in its local order."""
    check_sequence_split(seq_length, cp_size, cp_rank)
    chunk = seq_length // (2 * cp_size)
    starts = chunk_ids(cp_size, cp_rank)
    return torch.cat([torch.arange(start * chunk, (start + 1) * chunk, device=device) for start in starts])


def rank_chunk_order(cp_size: int) -> list[int]:
    """Global chunk index at each place of the rank-chunk order: ``[0, 2cp-1, 1, 2cp-2, ...]``."""
    return [chunk for rank in range(cp_size) for chunk in chunk_ids(cp_size, rank)]


def _natural_order(cp_size: int) -> list[int]:
    """Place in the rank-chunk order of each global chunk (the inverse permutation of ``rank_chunk_order``)."""
    order = rank_chunk_order(cp_size)
    inverse = [0] * len(order)
    for place, chunk in enumerate(order):
        inverse[chunk] = place
    return inverse


def _permute_chunks(x: torch.Tensor, dim: int, chunks: list[int]) -> torch.Tensor:
    """``x`` with its ``dim`` cut into ``len(chunks)`` equal chunks, reassembled as ``chunks`` lists them."""
    pieces = x.chunk(len(chunks), dim=dim)
    return torch.cat([pieces[i] for i in chunks], dim=dim)


def to_natural_order(x: torch.Tensor, *, dim: int, cp_size: int) -> torch.Tensor:
    """A full sequence in rank-chunk order (e.g. all-gathered over cp) -> natural order along ``dim``."""
    check_sequence_split(x.shape[dim], cp_size)
    return _permute_chunks(x, dim, _natural_order(cp_size))


def to_rank_chunk_order(x: torch.Tensor, *, dim: int, cp_size: int) -> torch.Tensor:
    """A full sequence in natural order -> rank-chunk order along ``dim`` (inverse of ``to_natural_order``)."""
    check_sequence_split(x.shape[dim], cp_size)
    return _permute_chunks(x, dim, rank_chunk_order(cp_size))


def split_sequence(x: torch.Tensor, *, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This cp rank's two chunks of the full sequence ``x`` along ``dim``: ``[..., s, ...] -> [..., s/cp, ...]``.

    Raises:
        ValueError: ``x.shape[dim]`` is not divisible by ``2 * cp_size``.
    """
    if cp_size == 1:
        return x
    check_sequence_split(x.shape[dim], cp_size, cp_rank)
    pieces = x.chunk(2 * cp_size, dim=dim)
    first, second = chunk_ids(cp_size, cp_rank)
    return torch.cat([pieces[first], pieces[second]], dim=dim).contiguous()


def split_batch(batch: Mapping[str, torch.Tensor], *, cp_size: int, cp_rank: int,
                seq_dim: int = 1) -> dict[str, torch.Tensor]:
    """Every ``[b, s]`` entry of a micro-batch (tokens, labels, loss_mask, position_ids) cut to this cp rank's
    ``[b, s/cp]``; position ids keep their global values, so RoPE and learned positions see the true positions."""
    return {key: split_sequence(value, dim=seq_dim, cp_size=cp_size, cp_rank=cp_rank) for key, value in batch.items()}


__all__ = ["check_sequence_split", "chunk_ids", "local_positions", "rank_chunk_order", "split_batch",
           "split_sequence", "to_natural_order", "to_rank_chunk_order"]
