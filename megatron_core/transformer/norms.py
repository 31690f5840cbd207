"""LayerNorm and RMSNorm over the hidden dim, running the fused kernels of ``kernels`` (fp32 statistics).

Their parameters are replicated over tp. Under sequence parallelism each tp rank normalizes its own chunk of
the sequence, so the weight grads are partial sums: the parameters carry ``sequence_parallel = True`` and
``finalize_model_grads`` all-reduces them over tp.
"""
from __future__ import annotations

import torch
from torch import nn

import kernels
from megatron_core.config import TransformerConfig
from megatron_core.tensor_parallel import set_tensor_model_parallel_attributes
from megatron_core.tensor_parallel.initialization import InitRecipe, init_method_constant


def _replicated(tensor: torch.Tensor, config: TransformerConfig, value: float) -> nn.Parameter:
    param = nn.Parameter(tensor)
    param.init_recipe = InitRecipe(0, init_method_constant(value), tuple(tensor.shape))
    set_tensor_model_parallel_attributes(param, is_parallel=False, dim=-1, stride=1)
    param.sequence_parallel = config.sequence_parallel
    return param


class LayerNorm(nn.Module):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dim; ``[..., h] -> [..., h]``."""

    def __init__(self, config: TransformerConfig, hidden_size: int, *, device=None) -> None:
        super().__init__()
        self.eps = config.layernorm_epsilon
        self.weight = _replicated(torch.ones(hidden_size, dtype=config.params_dtype, device=device), config, 1.0)
        self.bias = _replicated(torch.zeros(hidden_size, dtype=config.params_dtype, device=device), config, 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.layer_norm(x, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim; ``[..., h] -> [..., h]``."""

    def __init__(self, config: TransformerConfig, hidden_size: int, *, device=None) -> None:
        super().__init__()
        self.eps = config.layernorm_epsilon
        self.weight = _replicated(torch.ones(hidden_size, dtype=config.params_dtype, device=device), config, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


def Norm(config: TransformerConfig, hidden_size: int, *, device=None) -> nn.Module:  # noqa: N802 - a class factory
    """The norm named by ``config.normalization`` (the default norm of a layer spec)."""
    cls = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
    return cls(config, hidden_size, device=device)
