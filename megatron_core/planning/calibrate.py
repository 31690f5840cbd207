"""Measuring this machine for the planner (``tools/plan_parallelism.py --calibrate FILE``): the GEMM efficiency
curve, memory bandwidth, the fixed cost of one transformer layer's forward + backward, and the all-reduce's
latency and bus bandwidth over ``world_size`` gloo ranks (or NCCL on GPUs). Each is a small benchmark of a few
hundred milliseconds; the result is a hardware profile (``planning.hardware``) written as JSON.

- GEMMs ``[d, d] x [d, d]`` and skinny ones (``[4096, d] x [d, 256]``) for d from 16 to 1024; the rate fits
  ``R d / (d + d_half)`` (least squares on ``1 / rate = 1 / R + (d_half / R) / d``): ``peak_tflops = R``,
  ``compute_efficiency = 1``, ``gemm_half_dim = d_half``.
- Memory bandwidth: ``z = x + y`` on 32 MiB tensors (3 x 32 MiB moved).
- Layer overhead: forward + backward of a GPT layer at hidden 32, 8 tokens, where no FLOP or byte matters.
- All-reduce: median time of 8-byte and 16 MiB all-reduces: latency and ``2 (n - 1) / n x bytes / time``.
On a CPU every rank runs one thread (as the test and benchmark ranks do); devices = ranks, one node.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import numpy
import torch
import torch.distributed as dist


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn: Callable[[], object], device: torch.device, *, repeats: int = 5, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_curve(device: torch.device, dtype: torch.dtype, dims=(16, 32, 64, 128, 256, 512, 1024)) -> dict:
    """``peak_tflops`` and ``gemm_half_dim`` fitted to measured GEMM times (see the module docstring): least
    squares, relative to each time, of ``t = t0 + F / R + (d_half / R) F / d`` (``F`` the FLOPs, ``d`` the smallest
    dimension, ``t0`` the call's fixed cost, which the layer overhead already counts)."""
    rows, times = [], []
    for d in dims:
        for m, n, k in ((d, d, d), (4096, 256, d), (4096, d, 256)):
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            seconds = _median_seconds(lambda: a @ b, device)
            flops = 2.0 * m * n * k
            rows.append([1.0 / seconds, flops / seconds, flops / min(m, n, k) / seconds])
            times.append(1.0)
    (t0, inverse_rate, half_over_rate), *_ = numpy.linalg.lstsq(numpy.array(rows), numpy.array(times), rcond=None)
    inverse_rate = max(inverse_rate, 1e-18)
    return {"peak_tflops": 1.0 / inverse_rate / 1e12, "compute_efficiency": 1.0,
            "gemm_half_dim": max(half_over_rate / inverse_rate, 0.0)}


def memory_bandwidth_gbps(device: torch.device, dtype: torch.dtype = torch.float32) -> float:
    numel = (32 << 20) // torch.finfo(dtype).bits * 8
    x, y = torch.randn(numel, device=device, dtype=dtype), torch.randn(numel, device=device, dtype=dtype)
    z = torch.empty_like(x)
    seconds = _median_seconds(lambda: torch.add(x, y, out=z), device)
    return 3 * x.numel() * x.element_size() / seconds / 1e9


def layer_overhead_us(dtype: torch.dtype) -> float:
    """The per-layer cost no FLOP explains: forward + backward of a GPT of 3 layers minus one of 1 layer, at
    hidden 32 and 8 tokens, over 2 (call inside a process group; the model is local: no collective runs)."""
    from megatron_core import destroy_model_parallel, initialize_model_parallel
    from megatron_core.config import TransformerConfig
    from megatron_core.models import GPTModel
    from megatron_core.tensor_parallel import model_parallel_seed
    from megatron_core.transformer.specs import layer_spec_for
    state = initialize_model_parallel()
    model_parallel_seed(1, tp_rank=state.tp_rank, tracker=state.rng_tracker)
    tokens = torch.randint(0, 64, (1, 8))
    positions = torch.arange(8).unsqueeze(0)
    seconds = {}
    for layers in (1, 3):
        config = TransformerConfig(num_layers=layers, hidden_size=32, num_attention_heads=4, params_dtype=dtype,
                                   bf16=dtype == torch.bfloat16, hidden_dropout=0.1, attention_dropout=0.1,
                                   max_position_embeddings=8)
        model = GPTModel(config, parallel_state=state, vocab_size=64, max_sequence_length=8,
                         layer_spec=layer_spec_for(config), make_vocab_size_divisible_by=8)
        seconds[layers] = _median_seconds(
            lambda: model(tokens, positions, labels=tokens).float().sum().backward(), torch.device("cpu"),
            repeats=15, warmup=3)
    destroy_model_parallel(state)
    return max(seconds[3] - seconds[1], 0.0) / 2 * 1e6


def allreduce(device: torch.device, group=None) -> dict:
    """Latency (us) and bus bandwidth (GB/s) of an all-reduce over ``group`` (call on every rank)."""
    ranks = dist.get_world_size(group)
    small = torch.zeros(2, device=device)
    large = torch.zeros(4 << 20, device=device)  # 16 MiB of fp32
    latency = _median_seconds(lambda: dist.all_reduce(small, group=group), device, repeats=9)
    seconds = _median_seconds(lambda: dist.all_reduce(large, group=group), device)
    busbw = 2 * (ranks - 1) / ranks * large.numel() * 4 / max(seconds - latency, 1e-9) / 1e9
    return {"latency_us": latency * 1e6, "bus_gbps": busbw}


def calibrate_rank(dtype_name: str = "bfloat16") -> dict:
    """Run on every rank of a process group (``run_distributed``): this rank's measurements. On a CPU with one
    thread per rank, as the ranks that train here run."""
    device = torch.device("cpu")
    dtype = getattr(torch, dtype_name)
    torch.set_num_threads(1)
    comm = allreduce(device)
    dist.barrier()
    fields = gemm_curve(device, dtype)
    dist.barrier()
    fields.update(memory_bandwidth_gbps=memory_bandwidth_gbps(device), layer_overhead_us=layer_overhead_us(dtype))
    world = dist.get_world_size()
    fields.update(intra_node_bandwidth_gbps=comm["bus_gbps"], inter_node_bandwidth_gbps=comm["bus_gbps"],
                  intra_node_latency_us=comm["latency_us"], inter_node_latency_us=comm["latency_us"],
                  devices_per_node=world, comm_overlap=0.0, name=f"calibrated-cpu-{world}ranks")
    return fields


def calibrate(world_size: int = 2, *, dtype_name: str = "bfloat16", memory_per_device_gb: float = 0.0,
              distributed=None) -> dict:
    """A profile of this machine measured on ``world_size`` gloo ranks (``distributed``: a
    ``run_distributed``-like callable, e.g. the test suite's pool): each field the median over ranks."""
    if distributed is None:
        from megatron_core.testing import run_distributed as distributed
    per_rank = distributed(world_size, calibrate_rank, dtype_name)
    fields = {}
    for name, value in per_rank[0].items():
        values = [rank[name] for rank in per_rank]
        fields[name] = float(statistics.median(values)) if isinstance(value, float) else value
    if not memory_per_device_gb:
        import os
        memory_per_device_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / world_size
    fields["memory_per_device_gb"] = memory_per_device_gb
    return fields


__all__ = ["calibrate", "calibrate_rank", "gemm_curve", "memory_bandwidth_gbps", "layer_overhead_us", "allreduce"]
