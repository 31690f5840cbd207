"""The feed-forward block: fc1 column-parallel, GELU, SwiGLU or gpt-oss's quick GeGLU, fc2 row-parallel
(Megatron-LM)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_core.config import TransformerConfig
from megatron_core.fp8.config import layer_fp8
from megatron_core.parallel_state import ParallelState
from megatron_core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    init_method_normal,
    scaled_init_method_normal,
)

GATED_ACTIVATIONS = ("swiglu", "quick_geglu")
"""Activations of ``[gate; up]`` (fc1 twice as wide, partition stride 2)."""
QUICK_GELU_ALPHA = 1.702
"""quick GeLU's ``x * sigmoid(1.702 x)`` (gpt-oss's ``swiglu_alpha``)."""


def mlp_activation(x: torch.Tensor, activation: str, *, gelu_approximate: str = "none",
                   clamp_value: Optional[float] = None, linear_offset: float = 0.0) -> torch.Tensor:
    """The MLP's nonlinearity.

    Gated (``GATED_ACTIVATIONS``), ``[..., 2f]`` (gate; up) -> ``act(gate) * (up + linear_offset)`` ``[..., f]``
    with ``act`` silu (``"swiglu"``) or ``x * sigmoid(1.702 x)`` (``"quick_geglu"``, gpt-oss); with
    ``clamp_value`` v the gate is clamped to ``<= v`` and up to ``[-v, v]`` first (gpt-oss: v 7, offset 1;
    Megatron's ``--activation-func-clamp-value`` / ``--glu-linear-offset``).
    ``"squared_relu"`` -> ``relu(x)^2`` (Primer; Megatron-LM's --squared-relu); ``"gelu"`` (tanh-approximated
    with ``gelu_approximate="tanh"``).
    """
    if activation in GATED_ACTIVATIONS:
        gate, up = x.chunk(2, dim=-1)
        if clamp_value is not None:
            gate, up = gate.clamp(max=clamp_value), up.clamp(-clamp_value, clamp_value)
        gate = F.silu(gate) if activation == "swiglu" else gate * torch.sigmoid(QUICK_GELU_ALPHA * gate)
        return gate * (up + linear_offset) if linear_offset else gate * up
    if activation == "squared_relu":
        return F.relu(x).square()
    return F.gelu(x, approximate=gelu_approximate)


def activation_options(config: TransformerConfig) -> dict:
    """``mlp_activation``'s keyword arguments from the config."""
    return dict(gelu_approximate="tanh" if config.openai_gelu else "none",
                clamp_value=config.activation_func_clamp_value, linear_offset=config.glu_linear_offset)


class MLP(nn.Module):
    """``fc2(act(fc1(x)))`` with fc1 ``[h -> ffn]`` split over tp by columns and fc2 ``[ffn -> h]`` by rows.

    GeLU is exact unless ``config.openai_gelu`` (the tanh approximation GPT-2 uses).

    SwiGLU and quick GeGLU: fc1 produces ``[gate; up]`` (``2 ffn`` rows) with partition stride 2, so every tp
    rank holds matching halves of both: rank r has rows ``gate[r]`` and ``up[r]`` and computes
    ``act(gate_r) * (up_r + offset)`` (``mlp_activation``; elementwise, so the clamp needs no communication).

    fc1 and fc2 run in FP8 when ``layer_fp8(config, layer_number)`` says so.

    forward: ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism) -> ``(output, bias)`` where output
    has the input's shape and is all-reduced (reduce-scattered) over tp, and bias is fc2's bias or None.
    """

    def __init__(self, config: TransformerConfig, *, layer_number: int, parallel_state: ParallelState) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.gated, self.activation_name = config.activation in GATED_ACTIVATIONS, config.activation
        self.activation_options = activation_options(config)
        common = dict(tp_group=parallel_state.tp_group, sequence_parallel=config.sequence_parallel,
                      tp_comm_overlap=config.tp_comm_overlap, weight_grad_store=parallel_state.weight_grad_store,
                      params_dtype=config.params_dtype, device=parallel_state.device, bias=config.add_bias_linear,
                      fp8=layer_fp8(config, layer_number))
        fc1_size = 2 * config.ffn_hidden_size if self.gated else config.ffn_hidden_size
        self.linear_fc1 = ColumnParallelLinear(config.hidden_size, fc1_size, stride=2 if self.gated else 1,
                                               init_method=init_method_normal(config.init_method_std), **common)
        self.linear_fc2 = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, input_is_parallel=True, skip_bias_add=True,
            init_method=scaled_init_method_normal(config.init_method_std, config.num_layers), **common)

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., ffn/tp]`` (``[..., 2 ffn/tp]`` when gated) -> ``[..., ffn/tp]``."""
        return mlp_activation(x, self.activation_name, **self.activation_options)

    def forward(self, hidden: torch.Tensor):
        intermediate, _ = self.linear_fc1(hidden)
        return self.linear_fc2(self.activation(intermediate))
