"""Measuring this machine for the planner (``tools/plan_parallelism.py --calibrate FILE``): the GEMM efficiency
curve, the fixed cost of one transformer layer's forward + backward, the rate of its element-wise ops, and the
all-reduce's latency and bus bandwidth over ``world_size`` gloo ranks, all ranks measuring at once (as they
will train). Each is a small benchmark; the result is a hardware profile (``planning.hardware``) as JSON.

- GEMMs ``[d, d] x [d, d]`` and skinny ones (``[4096, d] x [d, 256]``, ``[4096, 256] x [256, d]``) for d from
  16 to 1024, each in the forward, input-gradient and weight-gradient orientation; least squares (relative to
  each time) of ``t = t0 + F / R + (d_half / R) F / d``: ``peak_tflops = R``, ``compute_efficiency = 1``,
  ``gemm_half_dim = d_half`` (``t0``, the call's fixed cost, is in the layer overhead).
- Layer overhead: forward + backward of a GPT layer at hidden 32, 8 tokens (a GPT of 9 layers minus one of
  1, over 8), where no FLOP or byte matters.
- Element-wise rate (``memory_bandwidth_gbps``): a GPT layer at hidden 192 and 384 tokens, less its modeled
  GEMM, attention and overhead time, over the planner's element-wise bytes for it. On a CPU, dropout's random
  numbers, dtype conversions and ``exp`` make these ops slower than DRAM bandwidth; a GPU's are bound by HBM.
- All-reduce: ``2 (n - 1) / n x bytes / time`` of a 16 MiB all-reduce, and the latency between GEMMs (what a
  256 KiB all-reduce adds to two GEMMs, less its bytes' time; waiting for the slower rank included), the
  trimmed mean of paired differences; ``chunk_latency_us``: what cutting it into two halves issued at once adds
  (``--tp-comm-overlap``'s chunks), without GEMMs.
On a CPU every rank runs one thread (as the test and benchmark ranks do); devices = ranks, one node.
``fastest_cpu_dtype``: a CPU without bf16 instructions (AVX512-BF16 / AMX: e.g. AMD Zen 1-3) runs bf16 GEMMs
through a fallback ~20x slower than fp32; there the calibration and the steps it predicts run in fp32.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import numpy
import torch
import torch.distributed as dist

from megatron_core.planning.hardware import Hardware
from megatron_core.planning.layer_cost import elementwise_layer_bytes, layer_forward_cost


class BusyMachineError(RuntimeError):
    """The calibration's measurements contradict each other (a layer faster than its own GEMMs): the machine's
    speed changed while measuring. ``calibrate`` measures once more before giving up."""


def _timings(fn: Callable[[], object], repeats: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _trimmed_mean(values: list[float], trim: float = 0.1) -> float:
    """The mean of ``values`` without their lowest and highest ``trim`` share: what many collectives cost in sum
    (a step pays each one's mean, waits included), robust to a neighbour's spike."""
    ordered = sorted(values)
    cut = int(len(ordered) * trim)
    return statistics.fmean(ordered[cut:len(ordered) - cut])


def _median_seconds(fn: Callable[[], object], *, repeats: int = 5) -> float:
    """The median of ``repeats`` timings: the typical cost, as a step pays it (``time_validation`` takes the
    median step too)."""
    return statistics.median(_timings(fn, repeats))


def fastest_cpu_dtype(dim: int = 256, slowdown: float = 2.0) -> str:
    """``"bfloat16"`` where this CPU's bf16 ``[dim, dim]`` GEMM (one thread) takes under ``slowdown`` times the
    fp32 one, else ``"float32"``: the dtype in which calibrating and timing steps measure the hardware rather
    than an emulation of it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = {}
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.randn(dim, dim, dtype=dtype), torch.randn(dim, dim, dtype=dtype)
            seconds[dtype] = _median_seconds(lambda: a @ b, repeats=3)
    finally:
        torch.set_num_threads(threads)
    return "bfloat16" if seconds[torch.bfloat16] < slowdown * seconds[torch.float32] else "float32"


def gemm_curve(dtype: torch.dtype, dims=(16, 32, 64, 128, 256, 512, 1024)) -> dict:
    """``peak_tflops`` and ``gemm_half_dim`` fitted to measured GEMM times (see the module docstring)."""
    rows = []
    for d in dims:
        for m, n, k in ((d, d, d), (4096, 256, d), (4096, d, 256)):
            a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            at, bt = a.t().contiguous(), b.t().contiguous()
            for product in (lambda: a @ b, lambda: a @ bt.t(), lambda: at.t() @ b):  # forward, dgrad, wgrad
                seconds, flops = _median_seconds(product), 2.0 * m * n * k
                rows.append([1.0 / seconds, flops / seconds, flops / min(m, n, k) / seconds])
    (_, inverse_rate, half_over_rate), *_ = numpy.linalg.lstsq(numpy.array(rows), numpy.ones(len(rows)), rcond=None)
    inverse_rate = max(float(inverse_rate), 1e-18)
    return {"peak_tflops": 1.0 / inverse_rate / 1e12, "compute_efficiency": 1.0,
            "gemm_half_dim": max(float(half_over_rate) / inverse_rate, 0.0)}


def _gpt_layer_seconds(dtype: torch.dtype, *, hidden: int, heads: int, seq: int, batch: int, layers: int = 3,
                       repeats: int = 9) -> tuple[float, object]:
    """Seconds of one GPT layer's forward + backward (a GPT of ``layers`` layers minus one of 1, over
    ``layers - 1``) at this shape, dropout 0.1; and the layer's config (call inside a process group: the model
    is local, no collective)."""
    from megatron_core import destroy_model_parallel, initialize_model_parallel
    from megatron_core.config import TransformerConfig
    from megatron_core.models import GPTModel
    from megatron_core.tensor_parallel import model_parallel_seed
    from megatron_core.transformer.specs import layer_spec_for
    state = initialize_model_parallel()
    model_parallel_seed(1, tp_rank=state.tp_rank, tracker=state.rng_tracker)
    tokens, positions = torch.randint(0, 64, (batch, seq)), torch.arange(seq).expand(batch, seq)
    seconds, config = {}, None
    for count in (1, layers):
        config = TransformerConfig(num_layers=count, hidden_size=hidden, num_attention_heads=heads, params_dtype=dtype,
                                   bf16=dtype == torch.bfloat16, hidden_dropout=0.1, attention_dropout=0.1,
                                   max_position_embeddings=seq)
        model = GPTModel(config, parallel_state=state, vocab_size=64, max_sequence_length=seq,
                         layer_spec=layer_spec_for(config), make_vocab_size_divisible_by=8)
        seconds[count] = _median_seconds(lambda: model(tokens, positions, labels=tokens).float().sum().backward(),
                                         repeats=repeats)
    destroy_model_parallel(state)
    return max(seconds[layers] - seconds[1], 0.0) / (layers - 1), config


def layer_overhead_us(dtype: torch.dtype) -> float:
    """The per-layer cost no FLOP or byte explains: one layer at hidden 32 and 8 tokens."""
    return _gpt_layer_seconds(dtype, hidden=32, heads=4, seq=8, batch=1, layers=9, repeats=21)[0] * 1e6


def elementwise_bandwidth_gbps(dtype: torch.dtype, fields: dict) -> float:
    """The rate of the framework's element-wise ops in the planner's bytes (see the module docstring); ``fields``
    holds the GEMM curve and layer overhead measured before."""
    seconds, config = _gpt_layer_seconds(dtype, hidden=192, heads=3, seq=384, batch=1)
    machine = Hardware(num_devices=1, memory_per_device_gb=1, **{k: fields[k] for k in (
        "peak_tflops", "compute_efficiency", "gemm_half_dim", "layer_overhead_us")})
    cost = layer_forward_cost(config, machine, micro_batch_size=1, seq_length=384, flash=False, mask_bytes=2)
    rest = seconds - 3 * (cost.gemm + cost.attention) - machine.layer_overhead_us * 1e-6
    nbytes = 3 * elementwise_layer_bytes(config, micro_batch_size=1, seq_length=384, flash=False, mask_bytes=2)
    if seconds <= 0 or rest <= 0.05 * seconds:
        raise BusyMachineError(f"calibration: one layer took {seconds * 1e3:.1f} ms, of which the GEMMs and overhead "
                           f"explain all but {rest * 1e3:.1f} ms; the machine was busy: calibrate again when idle")
    return nbytes / rest / 1e9


def allreduce(group=None, dtype: torch.dtype = torch.bfloat16, *, samples: int = 60) -> dict:
    """Latency (us) and bus bandwidth (GB/s) of an all-reduce over ``group`` (call on every rank).

    - Bandwidth: a 16 MiB all-reduce alone.
    - Latency: what one 256 KiB all-reduce adds to two GEMMs (about the compute a step runs between its
      collectives), less its bytes' time. Collectives issued between computations, as a step issues them, cost
      more than alone: waking the transport, waiting for the slower rank. The mean (trimmed 10% each side) of
      ``samples`` paired differences, both variants timed in turn after a barrier each, so that the machine's
      drift cancels in each pair; a step pays the mean of its many collectives. Timing each variant in its own
      block of rounds, as before, put it anywhere from 0 to 4.5 ms between calibrations here.
    - ``chunk_latency_us``: what cutting the all-reduce into two halves issued at once adds
      (``--tp-comm-overlap``'s chunks), back to back without GEMMs: the transport's cost of the second chunk
      (the wait for the slower rank is paid once, by the first). With GEMMs between, that difference of two
      noisy timings swung from 0.5 to 2 ms."""
    ranks = dist.get_world_size(group)
    ring = 2 * (ranks - 1) / ranks
    large, message = torch.zeros(4 << 20), torch.zeros(128 << 10, dtype=dtype)
    seconds = _median_seconds(lambda: dist.all_reduce(large, group=group))
    busbw = ring * large.numel() * 4 / seconds
    a, w = torch.randn(512, 256, dtype=dtype), torch.randn(256, 1024, dtype=dtype)
    halves = message.chunk(2)

    def segment(gemms: int, chunks: int) -> float:
        dist.barrier(group=group)  # every variant starts with the ranks aligned, as after a step's collective
        start = time.perf_counter()
        for _ in range(gemms):
            a @ w
        if chunks == 1:
            dist.all_reduce(message, group=group)
        elif chunks == 2:  # issued at once, then waited for
            for work in [dist.all_reduce(half, group=group, async_op=True) for half in halves]:
                work.wait()
        return time.perf_counter() - start

    variants = ((2, 0), (2, 1), (0, 1), (0, 2))
    for variant in variants * 2:  # warm-up
        segment(*variant)
    added, chunked = [], []
    for _ in range(samples):
        alone, whole, bare, halved = (segment(*variant) for variant in variants)
        added.append(whole - alone)
        chunked.append(halved - bare)
    latency = max(_trimmed_mean(added) - ring * message.numel() * message.element_size() / busbw, 0.0)
    return {"latency_us": latency * 1e6, "bus_gbps": busbw / 1e9,
            "chunk_latency_us": max(statistics.median(chunked), 0.0) * 1e6}


def calibrate_rank(dtype_name: str = "bfloat16") -> dict:
    """Run on every rank of a process group (``run_distributed``): this rank's measurements, on one thread."""
    dtype = getattr(torch, dtype_name)
    torch.set_num_threads(1)
    comm = allreduce(dtype=dtype)
    dist.barrier()
    fields = gemm_curve(dtype)
    dist.barrier()
    fields["layer_overhead_us"] = layer_overhead_us(dtype)
    dist.barrier()
    fields["memory_bandwidth_gbps"] = elementwise_bandwidth_gbps(dtype, fields)
    world = dist.get_world_size()
    fields.update(intra_node_bandwidth_gbps=comm["bus_gbps"], inter_node_bandwidth_gbps=comm["bus_gbps"],
                  intra_node_latency_us=comm["latency_us"], inter_node_latency_us=comm["latency_us"],
                  chunk_latency_us=comm["chunk_latency_us"],
                  devices_per_node=world, comm_overlap=0.0, name=f"calibrated-cpu-{world}ranks")
    return fields


def calibrate(world_size: int = 2, *, dtype_name: str = "bfloat16", memory_per_device_gb: float = 0.0,
              distributed=None) -> dict:
    """A profile of this machine measured on ``world_size`` gloo ranks (``distributed``: a
    ``run_distributed``-like callable, e.g. the test suite's pool): each field the median over ranks. A
    ``BusyMachineError`` (the machine's speed changed while measuring) measures once more before it propagates."""
    if distributed is None:
        from megatron_core.testing import run_distributed as distributed
    try:
        per_rank = distributed(world_size, calibrate_rank, dtype_name)
    except BusyMachineError:  # a neighbour's burst between the GEMM curve and the layer: measure again, once
        per_rank = distributed(world_size, calibrate_rank, dtype_name)
    fields = {}
    for name, value in per_rank[0].items():
        values = [rank[name] for rank in per_rank]
        fields[name] = float(statistics.median(values)) if isinstance(value, float) else value
    if not memory_per_device_gb:
        memory_per_device_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / world_size
    fields["memory_per_device_gb"] = memory_per_device_gb
    return fields


__all__ = ["BusyMachineError", "calibrate", "calibrate_rank", "fastest_cpu_dtype", "gemm_curve", "layer_overhead_us",
           "elementwise_bandwidth_gbps", "allreduce"]
