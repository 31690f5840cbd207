"""Key/value cache for incremental decoding: each layer keeps the keys and values of the tokens seen so far,
so a generation step runs only the new tokens through the model."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch


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
    """

    max_sequence_length: int
    batch_size: int
    offset: int = 0
    key_value: dict[int, tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=dict)

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
            shape = (self.max_sequence_length, *key.shape[1:])
            self.key_value[layer_number] = (key.new_empty(shape), value.new_empty(shape))
        key_buffer, value_buffer = self.key_value[layer_number]
        key_buffer[self.offset:end] = key
        value_buffer[self.offset:end] = value
        return key_buffer[:end], value_buffer[:end]

    def attention_mask(self, s_new: int, device: torch.device) -> Optional[torch.Tensor]:
        """None (plain causal) when nothing is cached yet; else a boolean ``[1, 1, s_new, offset + s_new]``
        mask (True = masked) letting new token i see every cached token and new tokens ``<= i``."""
        if self.offset == 0:
            return None
        query_pos = torch.arange(self.offset, self.offset + s_new, device=device).unsqueeze(1)
        key_pos = torch.arange(self.offset + s_new, device=device).unsqueeze(0)
        return (key_pos > query_pos).view(1, 1, s_new, self.offset + s_new)


__all__ = ["InferenceCache"]
