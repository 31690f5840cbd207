"""``--deterministic-mode`` (Megatron-LM's flag): bitwise-repeatable runs.

Two runs with the same flags, data and layout then give the same losses and weights to the last bit:
``torch.use_deterministic_algorithms(True)`` (an op without a deterministic kernel raises instead of
running), and on CUDA cuBLAS's fixed workspace (``CUBLAS_WORKSPACE_CONFIG``), cuDNN without autotuning and
NCCL's ring algorithm (``NCCL_ALGO``, read when the communicators are made), unless the environment sets
them. Our Triton kernels use no atomics (the norms' weight grads are per-program rows summed on the host), and
the data order and initialization are seeded, so nothing else varies between runs.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch


@contextlib.contextmanager
def deterministic_mode(enabled: bool, *, cuda: bool) -> Iterator[None]:
    """Within the block (the training run), deterministic algorithms when ``enabled``; the previous setting
    is restored after it (the process may run more than one job, as the test pools do)."""
    if not enabled:
        yield
        return
    if cuda:  # CUDA-only path
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        os.environ.setdefault("NCCL_ALGO", "Ring")
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


__all__ = ["deterministic_mode"]
