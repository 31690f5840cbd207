"""Key/value cache for incremental decoding: each layer keeps the keys and values of the tokens seen so far,
so a generation step runs only the new tokens through the model. Multi-latent attention keeps its compressed
latents instead (``update_latent``)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch


def check_cache_inputs(attention_mask, *, sequence_parallel: bool, cp_size: int) -> None:
    """ValueError unless decoding with an inference cache can run: the causal mask (no explicit
    attention_mask), no sequence or context parallelism."""
    if attention_mask is not None or sequence_parallel or cp_size > 1:
        raise ValueError("an inference cache works with the causal mask (attention_mask=None) and "
                         "without sequence or context parallelism")


@dataclasses.dataclass
class InferenceCache:
    """The keys and values of this rank's layers (its pipeline stage, its tp share of the groups).

    Args:
        max_sequence_length: the most tokens one sequence may reach (prompt + generated).
        batch_size: sequences decoded together.
        offset: tokens already cached; position ids of new tokens start here. ``GPTModel.forward``
            advances it by the number of tokens it ran.
        key_value: ``{layer_number: (key, value)}``, buffers ``[max_sequence_length, b, groups/tp, d]``
            allocated on the layer's first call; rows ``[:offset]`` are valid.
        latents: ``{layer_number: (latent, k_pe)}`` of multi-latent attention layers, buffers
            ``[max_sequence_length, b, kv_lora_rank]`` and ``[max_sequence_length, b, qk_pos_emb_head_dim]``
            (the same on every tp rank), allocated on the layer's first call; rows ``[:offset]`` are valid.
    """

    max_sequence_length: int
    batch_size: int
    offset: int = 0
    key_value: dict[int, tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=dict)
    latents: dict[int, tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=dict)

    def check_room(self, s_new: int, batch_size: int) -> None:
        """Raises ValueError unless ``s_new`` more tokens of ``batch_size`` sequences fit."""
        if self.offset + s_new > self.max_sequence_length or batch_size != self.batch_size:
            raise ValueError(f"inference cache holds {self.max_sequence_length} tokens x batch {self.batch_size}; "
                             f"got offset {self.offset} + {s_new} new tokens x batch {batch_size}")

    def update(self, layer_number: int, key: torch.Tensor,
               value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores the new tokens' key and value ``[s_new, b, groups/tp, d]`` at ``offset`` and returns all
        keys and values so far ``[offset + s_new, b, groups/tp, d]``."""
        self.check_room(key.shape[0], key.shape[1])
        end = self.offset + key.shape[0]
        if layer_number not in self.key_value:
            self.key_value[layer_number] = (key.new_empty((self.max_sequence_length, *key.shape[1:])),
                                            value.new_empty((self.max_sequence_length, *value.shape[1:])))
        return self._append(self.key_value[layer_number], key, value, end)

    def update_latent(self, layer_number: int, latent: torch.Tensor,
                      k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Multi-latent attention: stores the new tokens' normed key/value latent ``[s_new, b, kv_lora_rank]``
        and rotated shared key ``[s_new, b, qk_pos_emb_head_dim]`` at ``offset``; returns every token's so far
        ``[offset + s_new, b, ...]``."""
        self.check_room(latent.shape[0], latent.shape[1])
        end = self.offset + latent.shape[0]
        if layer_number not in self.latents:
            self.latents[layer_number] = (latent.new_empty((self.max_sequence_length, *latent.shape[1:])),
                                          k_pe.new_empty((self.max_sequence_length, *k_pe.shape[1:])))
        return self._append(self.latents[layer_number], latent, k_pe, end)

    def _append(self, buffers: tuple[torch.Tensor, torch.Tensor], first: torch.Tensor, second: torch.Tensor,
                end: int) -> tuple[torch.Tensor, torch.Tensor]:
        first_buffer, second_buffer = buffers
        first_buffer[self.offset:end] = first
        second_buffer[self.offset:end] = second
        return first_buffer[:end], second_buffer[:end]

    def allocated_bytes(self) -> int:
        """Bytes of every buffer allocated so far (keys, values and latents of this rank's layers)."""
        buffers = [t for pair in (*self.key_value.values(), *self.latents.values()) for t in pair]
        return sum(t.numel() * t.element_size() for t in buffers)

    def bytes_per_token(self) -> float:
        """``allocated_bytes`` per token slot (``max_sequence_length * batch_size``): with multi-latent attention
        ``(kv_lora_rank + qk_pos_emb_head_dim) * layers * dtype size``; with self-attention
        ``2 * groups/tp * kv_channels * layers * dtype size``."""
        return self.allocated_bytes() / (self.max_sequence_length * self.batch_size)

    def attention_mask(self, s_new: int, device: torch.device,
                       window: Optional[tuple[int, int]] = None) -> Optional[torch.Tensor]:
        """None (plain causal: the core attention applies any window itself) when nothing is cached yet; else
        a boolean ``[1, 1, s_new, offset + s_new]`` mask (True = masked) letting the new token at global
        position p see the cached and new tokens at positions ``<= p``, and with a sliding ``window`` ``(left,
        right)`` (left -1: unbounded) only those ``>= p - left``."""
        if self.offset == 0:
            return None
        query_pos = torch.arange(self.offset, self.offset + s_new, device=device).unsqueeze(1)
        key_pos = torch.arange(self.offset + s_new, device=device).unsqueeze(0)
        masked = key_pos > query_pos
        if window is not None and window[0] >= 0:
            masked = masked | (key_pos < query_pos - window[0])
        return masked.view(1, 1, s_new, self.offset + s_new)


__all__ = ["InferenceCache", "check_cache_inputs"]
