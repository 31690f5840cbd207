"""A paged key/value cache: fixed-size blocks of token slots drawn from one pool, so requests of any length share
the memory without reserving a whole context each (the layout of vLLM's PagedAttention, arXiv 2309.06180).

Three pieces:

- ``BlockPool``: the ids of free blocks (rank 0's bookkeeping, no tensors). A request holds a block table, the
  list of its block ids; token position ``p`` of the request lives in slot ``table[p // block_size] * block_size
  + p % block_size``.
- ``PagedKVCache``: this rank's tensors, one key and one value buffer per layer of its pipeline stage,
  ``[num_blocks * block_size, groups/tp, d]``.
- ``PagedStep``: one forward of a packed batch (the new tokens of several requests in one sequence ``[1, T]``).
  It is what the model receives as ``inference_cache``: the attention module calls ``attention_mask`` and
  ``update`` exactly as it does on ``InferenceCache``, so the attention code needs no second path. ``update``
  writes the new keys/values into their slots and returns the keys/values of every request's context,
  concatenated ``[K, 1, groups/tp, d]``; the mask ``[1, 1, T, K]`` lets each new token see its own request's
  tokens up to its own position only (block-diagonal causal).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch

from megatron_core.config import TransformerConfig


class PoolExhausted(RuntimeError):
    """``BlockPool.allocate`` asked for more blocks than are free (the scheduler checks first: an internal error)."""


class BlockPool:
    """The free block ids of a pool of ``num_blocks`` blocks of ``block_size`` token slots each.

    Blocks are handed out lowest id first and come back with ``free``; a block freed twice or never allocated
    raises, so leaks and double frees surface in tests. No communication: only rank 0 holds a pool.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks} blocks of "
                             f"{block_size} slots")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives the lowest free id
        self._used: set[int] = set()
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` token slots."""
        return math.ceil(tokens / self.block_size)

    def allocate(self, count: int) -> list[int]:
        """``count`` block ids, removed from the free list. Raises PoolExhausted when fewer are free."""
        if count > len(self._free):
            raise PoolExhausted(f"{count} blocks requested, {len(self._free)} of {self.num_blocks} free")
        blocks = [self._free.pop() for _ in range(count)]
        self._used.update(blocks)
        self.peak_used = max(self.peak_used, len(self._used))
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Returns ``blocks`` to the pool. Raises ValueError for a block that is not in use."""
        for block in blocks:
            if block not in self._used:
                raise ValueError(f"block {block} is not in use (double free, or not from this pool)")
            self._used.remove(block)
            self._free.append(block)
        self._free.sort(reverse=True)


def bytes_per_block(config: TransformerConfig, *, num_local_layers: int, tp_size: int, block_size: int) -> int:
    """Bytes of one block on a rank holding ``num_local_layers`` layers: key + value,
    ``block_size x groups/tp x kv_channels`` each, in ``config.params_dtype``."""
    element = torch.empty((), dtype=config.params_dtype).element_size()
    groups = config.num_query_groups // tp_size
    return 2 * num_local_layers * block_size * groups * config.kv_channels * element


def blocks_in_memory(max_memory_bytes: int, config: TransformerConfig, *, num_local_layers: int, tp_size: int,
                     block_size: int) -> int:
    """How many blocks fit in ``max_memory_bytes`` on this rank (see ``bytes_per_block``). Raises ValueError when
    not even one block fits."""
    per_block = bytes_per_block(config, num_local_layers=num_local_layers, tp_size=tp_size, block_size=block_size)
    count = int(max_memory_bytes) // per_block
    if count < 1:
        raise ValueError(f"--inference-max-memory {max_memory_bytes} bytes holds no block: one block of "
                         f"{block_size} tokens takes {per_block} bytes on this rank; raise it to at least {per_block}")
    return count


class PagedKVCache:
    """This rank's key/value slots: per layer number, key and value ``[num_blocks * block_size, groups/tp, d]``,
    allocated on the layer's first ``write`` (shape, dtype and device of its keys). No communication."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.key_value: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def buffers(self, layer_number: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's key and value buffers, made like ``like`` ``[T, 1, groups/tp, d]`` on first use."""
        if layer_number not in self.key_value:
            shape = (self.num_blocks * self.block_size, *like.shape[2:])
            self.key_value[layer_number] = (like.new_zeros(shape), like.new_zeros(shape))
        return self.key_value[layer_number]

    def slots(self, tables: torch.Tensor, requests: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Slot indices of ``positions`` of ``requests`` (same shape), whose block tables are the rows of
        ``tables`` ``[R, max blocks]``."""
        return tables[requests, positions // self.block_size] * self.block_size + positions % self.block_size


@dataclasses.dataclass(frozen=True)
class StepEntry:
    """One request's share of a packed step: ``tokens`` fed at positions ``start .. start + len(tokens) - 1``,
    its keys/values kept in the blocks of ``block_table``."""

    block_table: tuple[int, ...]
    start: int
    tokens: tuple[int, ...]


class PagedStep:
    """The ``inference_cache`` of one packed forward (see the module docstring); built on every rank from the
    same plan, so every rank reads and writes the same slots.

    Attributes:
        tokens: ``[1, T]`` the new tokens of all entries, packed in entry order.
        positions: ``[1, T]`` their positions within their own requests.
        offset: what ``GPTModel.forward`` advances by T after the decoder (unused here: positions are explicit).
    """

    def __init__(self, cache: PagedKVCache, entries: Sequence[StepEntry], device: torch.device) -> None:
        if not entries:
            raise ValueError("a paged step needs at least one entry")
        ends = [e.start + len(e.tokens) for e in entries]
        for entry, end in zip(entries, ends):
            if end > len(entry.block_table) * cache.block_size:
                raise ValueError(f"positions up to {end} do not fit {len(entry.block_table)} blocks of "
                                 f"{cache.block_size} slots")
        width = max(len(e.block_table) for e in entries)
        tables = torch.tensor([list(e.block_table) + [0] * (width - len(e.block_table)) for e in entries])
        new = torch.tensor([len(e.tokens) for e in entries])
        ends_t, starts = torch.tensor(ends), torch.tensor([e.start for e in entries])
        index = torch.arange(len(entries))
        q_req, k_req = index.repeat_interleave(new), index.repeat_interleave(ends_t)  # [T], [K]
        q_pos = starts.repeat_interleave(new) + torch.arange(len(q_req)) - (new.cumsum(0) - new).repeat_interleave(new)
        k_pos = torch.arange(len(k_req)) - (ends_t.cumsum(0) - ends_t).repeat_interleave(ends_t)
        mask = (q_req[:, None] != k_req[None, :]) | (k_pos[None, :] > q_pos[:, None])  # [T, K], True = masked
        self.cache = cache
        self.num_tokens = len(q_req)
        self.write_slots = cache.slots(tables, q_req, q_pos).to(device)
        self.read_slots = cache.slots(tables, k_req, k_pos).to(device)
        self.mask = mask.view(1, 1, *mask.shape).to(device)
        self.tokens = torch.tensor([[t for e in entries for t in e.tokens]], dtype=torch.long, device=device)
        self.positions = q_pos.view(1, -1).to(device)
        self.offset = 0

    def check_room(self, s_new: int, batch_size: int) -> None:
        """Raises ValueError unless the model runs this step's packed ``[1, T]`` tokens."""
        if batch_size != 1 or s_new != self.num_tokens:
            raise ValueError(f"a paged step runs its {self.num_tokens} packed tokens as batch 1; got {s_new} "
                             f"tokens x batch {batch_size}")

    def attention_mask(self, s_new: int, device: torch.device) -> Optional[torch.Tensor]:
        """The boolean ``[1, 1, T, K]`` block-diagonal causal mask (True = masked)."""
        self.check_room(s_new, 1)
        return self.mask

    def update(self, layer_number: int, key: torch.Tensor,
               value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the new tokens' key and value ``[T, 1, groups/tp, d]`` into their slots and returns the
        keys and values of every entry's context ``[K, 1, groups/tp, d]`` (entry order, positions ascending)."""
        key_buffer, value_buffer = self.cache.buffers(layer_number, key)
        key_buffer[self.write_slots] = key[:, 0]
        value_buffer[self.write_slots] = value[:, 0]
        return key_buffer[self.read_slots].unsqueeze(1), value_buffer[self.read_slots].unsqueeze(1)


__all__ = ["BlockPool", "PoolExhausted", "PagedKVCache", "PagedStep", "StepEntry", "bytes_per_block",
           "blocks_in_memory"]
