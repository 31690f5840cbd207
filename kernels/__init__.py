"""Triton fused kernels (softmax, layernorm/RMSNorm, cross-entropy) with plain-torch references.

Each op lives in its own module with its kernels, reference, autograd function and dispatch. Importing this
package never fails on a machine without a GPU: Triton is imported guarded (in ``kernels._dispatch``) and,
when it is missing or cannot run for a tensor, every op runs its torch reference.

Dispatch (per call) through a ``KernelBackend`` object passed as ``backend=`` (a model passes its layout's,
``ParallelState.kernels``): mode "torch" forces torch; otherwise CUDA tensors run compiled Triton, CPU tensors
run the Triton kernels under the interpreter only in mode "triton" (with ``TRITON_INTERPRET=1`` set before
``kernels`` was imported), and anything else runs torch. ``backend.last[op]`` reports what ran.
This package never imports megatron_core.
"""
from kernels._dispatch import BACKENDS, KernelBackend, triton_unavailable_reason
from kernels.layernorm import layer_norm, rms_norm
from kernels.softmax import scaled_masked_softmax, scaled_upper_triang_masked_softmax
from kernels.xentropy import (
    CrossEntropyShardStats,
    cross_entropy,
    cross_entropy_loss_from_stats,
    cross_entropy_shard_backward,
    cross_entropy_shard_stats,
)

__all__ = [
    "BACKENDS",
    "CrossEntropyShardStats",
    "KernelBackend",
    "cross_entropy",
    "cross_entropy_loss_from_stats",
    "cross_entropy_shard_backward",
    "cross_entropy_shard_stats",
    "layer_norm",
    "rms_norm",
    "scaled_masked_softmax",
    "scaled_upper_triang_masked_softmax",
    "triton_unavailable_reason",
]
