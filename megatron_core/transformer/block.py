"""The layers of one pipeline stage (or one model chunk of it), activation recompute, and the final norm."""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch
from torch import nn

from megatron_core.config import TransformerConfig
from megatron_core.parallel_state import ParallelState
from megatron_core.tensor_parallel import checkpoint
from megatron_core.transformer.compile import compile_layer
from megatron_core.transformer.spec import TransformerLayerSpec

LAYER_SEED_OFFSET = 1000  # layer n is initialized from base_seed + 1000 + n (embeddings use smaller offsets)


@contextlib.contextmanager
def seeded_init(base_seed: int, offset: int) -> Iterator[None]:
    """Draws parameters inside the block from the CPU generator seeded with ``base_seed + offset``, then
    restores the generator: each module's init depends only on its global identity, not on which other
    modules this rank builds, so every tp/pp layout produces the same full weights."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(base_seed + offset)
        yield


class TransformerBlock(nn.Module):
    """Layers ``[offset, offset + count)`` of the model (see ``TransformerConfig.pipeline_layer_range``).

    Args:
        config, parallel_state, spec: the model's.
        base_seed: per-model init seed; layer n draws its weights from ``base_seed + 1000 + n``.
        pre_process: this chunk holds the model's first layers; otherwise ``forward`` reads the activation
            received from the previous stage, set by ``set_input_tensor``.
        post_process: this chunk holds the model's last layers; the final norm is applied.
        vp_stage: the model chunk index with interleaved pipelining.

    forward: hidden ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism) -> same shape.
    """

    def __init__(self, config: TransformerConfig, *, parallel_state: ParallelState, spec: TransformerLayerSpec,
                 base_seed: int, pre_process: bool = True, post_process: bool = True,
                 vp_stage: Optional[int] = None) -> None:
        super().__init__()
        config = config.bind_layout(parallel_state)  # the layout sizes come from the state
        self.config, self.pre_process, self.post_process = config, pre_process, post_process
        self.rng_tracker = parallel_state.rng_tracker  # replayed by full recompute
        offset, count = config.pipeline_layer_range(parallel_state.pp_rank, vp_stage)
        layers = []
        for number in range(offset + 1, offset + count + 1):  # global, 1-based
            with seeded_init(base_seed, LAYER_SEED_OFFSET + number):
                layers.append(spec.layer(config, layer_number=number, parallel_state=parallel_state, spec=spec))
        if config.compile:
            for layer in layers:
                compile_layer(layer)
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = (spec.final_norm(config, config.hidden_size, device=parallel_state.device,
                                                kernel_backend=parallel_state.kernel_backend)
                                if post_process else None)
        self.input_tensor: Optional[torch.Tensor] = None

    def set_input_tensor(self, input_tensor: Optional[torch.Tensor]) -> None:
        """The activation received from the previous pipeline stage (used when not pre_process)."""
        self.input_tensor = input_tensor

    def forward(self, hidden: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb: Optional[torch.Tensor] = None, inference_cache=None) -> torch.Tensor:
        """``inference_cache`` (an ``InferenceCache`` or None): incremental decoding, no recompute."""
        if not self.pre_process:
            if self.input_tensor is None:
                raise ValueError("this pipeline stage has no embedding: call set_input_tensor() with the "
                                 "previous stage's output before forward")
            hidden = self.input_tensor
        if inference_cache is not None:
            for layer in self.layers:
                hidden = layer(hidden, attention_mask, rotary_pos_emb, inference_cache=inference_cache)
            return hidden if self.final_layernorm is None else self.final_layernorm(hidden)
        for layers, recompute in self._segments():
            if recompute:
                hidden = checkpoint(self._run_layers, layers, hidden, attention_mask, rotary_pos_emb,
                                    rng_tracker=self.rng_tracker)
            else:
                hidden = self._run_layers(layers, hidden, attention_mask, rotary_pos_emb)
        if self.final_layernorm is not None:
            hidden = self.final_layernorm(hidden)
        elif not self.layers and not self.pre_process:
            # an empty chunk (a layout's "|" with no layers): its output must not be the received tensor itself,
            # which the schedule keeps as the input (to read its grad) while it frees the sent output
            hidden = hidden.clone()
        return hidden

    @staticmethod
    def _run_layers(layers: Sequence[nn.Module], hidden, attention_mask, rotary_pos_emb) -> torch.Tensor:
        for layer in layers:
            hidden = layer(hidden, attention_mask, rotary_pos_emb)
        return hidden

    def _segments(self) -> list[tuple[list[nn.Module], bool]]:
        """``(layers, recompute?)`` runs: full recompute "uniform" checkpoints chunks of
        recompute_num_layers layers, "block" checkpoints each of the first recompute_num_layers layers."""
        layers, config = list(self.layers), self.config
        if config.recompute_granularity != "full":
            return [(layers, False)]
        k = config.recompute_num_layers
        if config.recompute_method == "uniform":
            return [(layers[i: i + k], True) for i in range(0, len(layers), k)]
        return [([layer], i < k) for i, layer in enumerate(layers)]
