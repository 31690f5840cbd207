"""Triton fused kernels (softmax, layernorm/RMSNorm, cross-entropy) with plain-torch references.

Each op lives in its own module with its kernels, reference, autograd function and dispatch. Importing this
package never fails on a machine without a GPU: Triton is imported guarded (in ``kernels._dispatch``) and,
when it is missing or cannot run for a tensor, every op runs its torch reference.

Dispatch (per call): ``set_backend("torch")`` forces the reference; otherwise CUDA tensors run compiled
Triton, CPU tensors run the Triton kernels under the interpreter when ``TRITON_INTERPRET=1`` was set before
``kernels`` was imported, and anything else runs the reference. ``last_backend(op)`` reports what ran.
This package never imports megatron_core.
"""
from kernels._dispatch import (
    backend_report,
    clear_backend_report,
    get_backend,
    last_backend,
    record,
    set_backend,
    triton_unavailable_reason,
    use_backend,
)
from kernels.xentropy import (
    CrossEntropyShardStats,
    cross_entropy,
    cross_entropy_loss_from_stats,
    cross_entropy_shard_backward,
    cross_entropy_shard_stats,
)
from kernels.layernorm import layer_norm, rms_norm
from kernels.softmax import scaled_masked_softmax, scaled_upper_triang_masked_softmax

__all__ = [
    "CrossEntropyShardStats",
    "backend_report",
    "clear_backend_report",
    "cross_entropy",
    "cross_entropy_loss_from_stats",
    "cross_entropy_shard_backward",
    "cross_entropy_shard_stats",
    "get_backend",
    "last_backend",
    "layer_norm",
    "record",
    "rms_norm",
    "scaled_masked_softmax",
    "scaled_upper_triang_masked_softmax",
    "set_backend",
    "triton_unavailable_reason",
    "use_backend",
]
