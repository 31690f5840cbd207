"""A pre-norm transformer layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``, with bias-dropout-add."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_core.config import TransformerConfig
from megatron_core.parallel_state import ParallelState
from megatron_core.tensor_parallel import checkpoint

if TYPE_CHECKING:
    from megatron_core.transformer.spec import TransformerLayerSpec


class TransformerLayer(nn.Module):
    """One decoder layer built from the submodule classes of ``spec``.

    ``layer_number`` is global and 1-based (it names the layer in checkpoints at any pipeline layout).
    forward: hidden ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism), attention_mask, rotary
    angles -> hidden of the same shape. Communication happens inside attention and MLP.

    Hidden dropout acts on the replicated residual stream, so its mask is the same on every tp rank (default
    RNG); with sequence parallelism each rank holds a different chunk of the sequence and draws from the
    tracker's model-parallel state instead.
    """

    gathers_small_parameters = True  # ZeRO-3: the layer's norms and biases are gathered once, with the layer

    def __init__(self, config: TransformerConfig, *, layer_number: int, parallel_state: ParallelState,
                 spec: "TransformerLayerSpec") -> None:
        super().__init__()
        self.config, self.layer_number = config, layer_number
        self.rng_tracker = parallel_state.rng_tracker  # recompute replay; sequence-parallel dropout
        self.kernel_backend = parallel_state.kernel_backend  # the fused ops' choice (torch inside a compiled layer)
        device = parallel_state.device
        self.input_layernorm = spec.input_norm(config, config.hidden_size, device=device,
                                               kernel_backend=parallel_state.kernel_backend)
        self.self_attention = spec.self_attention(config, layer_number=layer_number, parallel_state=parallel_state,
                                                  core_attention=spec.core_attention)
        self.pre_mlp_layernorm = spec.pre_mlp_norm(config, config.hidden_size, device=device,
                                                   kernel_backend=parallel_state.kernel_backend)
        self.mlp = spec.mlp(config, layer_number=layer_number, parallel_state=parallel_state)

    def forward(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb: Optional[torch.Tensor] = None, inference_cache=None) -> torch.Tensor:
        """``inference_cache`` (an ``InferenceCache`` or None) is passed to self-attention when given."""
        cache = {} if inference_cache is None else {"inference_cache": inference_cache}
        normed = self._run("layernorm", self.input_layernorm, hidden)
        output, bias = self.self_attention(normed, attention_mask, rotary_pos_emb, **cache)
        hidden = self.bias_dropout_add(output, bias, hidden)
        mlp_module = getattr(self.mlp, "recompute_module", "mlp")  # "moe" for an MoE layer (Megatron's names)
        output, bias = self._run(mlp_module, self.mlp, self._run("layernorm", self.pre_mlp_layernorm, hidden))
        return self.bias_dropout_add(output, bias, hidden)

    def _run(self, module: str, function, hidden: torch.Tensor):
        """``function(hidden)``, checkpointed when selective recompute covers ``module`` ("mlp", "moe",
        "layernorm")."""
        if self.training and self.config.recomputes(module) and torch.is_grad_enabled():
            return checkpoint(function, hidden, rng_tracker=self.rng_tracker)
        return function(hidden)

    def bias_dropout_add(self, x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor) -> torch.Tensor:
        if bias is not None:
            x = x + bias
        if self.training and self.config.hidden_dropout > 0:
            rng = self.rng_tracker.fork() if self.config.sequence_parallel else contextlib.nullcontext()
            with rng:
                x = F.dropout(x, self.config.hidden_dropout)
        return residual + x
