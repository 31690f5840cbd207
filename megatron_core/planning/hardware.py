"""The machine the planner predicts for: one device's peak, memory bandwidth and GEMM efficiency curve, the
links between devices, and the framework's fixed cost per layer; shipped profiles for A100/H100/H200/B200
from their public specifications, and a JSON form that ``tools/plan_parallelism.py --calibrate`` writes after
measuring this machine (``planning.calibrate``).

Every number is one a user can check against a spec sheet or a benchmark:

- ``peak_tflops`` / ``fp8_peak_tflops``: dense bf16 / FP8 tensor-core peak of one device.
- ``compute_efficiency``: the fraction of that peak a large GEMM reaches; ``gemm_half_dim``: the GEMM
  dimension at which it is half that (``gemm_efficiency``: ``e d / (d + d_half)`` over the smallest of the
  GEMM's three dimensions, so attention's head dimension and an expert's few tokens run far below peak).
- ``memory_bandwidth_gbps``: HBM (or DRAM) bandwidth, which bounds the element-wise ops (norms, activations,
  residuals, rope, dropout, the loss's softmax, the optimizer step).
- ``intra_node_bandwidth_gbps`` / ``inter_node_bandwidth_gbps``: the bus bandwidth of a collective inside a
  node (NVLink) and per device between nodes (InfiniBand), each with a per-message ``latency_us``; a ring
  collective between nodes also pays ``ring_step_latency_us`` / ``net_step_latency_us`` per step.
- ``layer_overhead_us``: the fixed time of one layer's forward plus backward per micro-batch that no FLOP or
  byte explains (kernel launches, dispatch); about 1.5 ms on this CPU, 100 us assumed on a GPU.
- ``comm_overlap``: the fraction of data-parallel traffic that runs under backward compute (1 where
  collectives run on their own stream, as NCCL's; less on a CPU, where gloo's threads share the cores).
"""
from __future__ import annotations

import dataclasses
import json
import os
from types import MappingProxyType
from typing import Mapping, Optional


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
    """The cluster: devices, memory, links and the dense peak of one device."""

    num_devices: int
    memory_per_device_gb: float
    peak_tflops: float
    intra_node_bandwidth_gbps: float = 900.0
    """Bus bandwidth of a collective inside a node, GB/s (NVLink)."""
    inter_node_bandwidth_gbps: float = 50.0
    """Per-device bandwidth between nodes, GB/s (e.g. 400 Gb/s InfiniBand)."""
    devices_per_node: int = 8
    compute_efficiency: float = 0.5
    """Fraction of the peak that large matmuls reach."""
    gemm_half_dim: float = 0.0
    """GEMM dimension at which the efficiency is half of ``compute_efficiency`` (0: no size effect)."""
    memory_bandwidth_gbps: float = 0.0
    """Device memory bandwidth, GB/s; 0 leaves the element-wise ops out of the step time."""
    intra_node_latency_us: float = 0.0
    inter_node_latency_us: float = 0.0
    ring_step_latency_us: float = 0.0
    """Per step of a ring collective between nodes: a step inside a node (NVLink)..."""
    net_step_latency_us: float = 0.0
    """...and a step that crosses to the next node (``layer_cost.ring_steps_seconds``; NCCL's own tuning model,
    ``hwLat`` of Ring/Simple: 3.4 and 14 us)."""
    chunk_latency_us: Optional[float] = None
    """What each further chunk of a collective cut into chunks and issued at once (``--tp-comm-overlap``) adds to
    its latency; None: a whole latency each (NCCL runs every chunk as a kernel and ring of its own). Gloo's queued
    chunks share one wake-up of its thread: ``--calibrate`` measures it on a CPU."""
    layer_overhead_us: float = 0.0
    """Fixed seconds (x 1e-6) of one layer's forward + backward per micro-batch beyond its FLOPs and bytes."""
    comm_overlap: float = 0.0
    """Fraction of the data-parallel traffic hidden under backward compute."""
    sm_count: int = 0
    """Streaming multiprocessors of one device; 0: communication beside compute takes none of it (a CPU)."""
    collective_sms: float = 0.0
    """SMs a collective running beside compute occupies (NCCL's kernels): the GEMMs beside it lose
    ``collective_sms / sm_count`` of their throughput for as long as it runs (``step_time``'s ``overlap_tax``)."""
    pcie_bandwidth_gbps: float = 25.0
    """Host <-> device bandwidth (optimizer offload)."""
    fp8_peak_tflops: Optional[float] = None
    name: str = "custom"


# Public specifications (dense tensor-core peaks; HBM bandwidth; all-reduce bus bandwidth nccl-tests reports on
# NVLink; 8 NICs per node of HDR 200 Gb/s (A100) or NDR 400 Gb/s (H100/H200/B200) = 25 / 50 GB/s per GPU, of
# which a ring reaches ~90%). Large-GEMM efficiency: cuBLAS bf16 at 8192^3 reaches ~0.8 of peak on A100 and
# ~0.7 on H100/H200/B200 (public cuBLAS/torch.matmul benchmarks). SMs: 108 (A100 SXM), 132 (H100/H200 SXM),
# 148 (B200); 16 of them for a collective beside compute (Megatron-Bridge's performance guide sets
# NVTE_FWD/BWD_LAYERNORM_SM_MARGIN to "#SM for DP collectives = 16").
_GPU = MappingProxyType(dict(layer_overhead_us=100, comm_overlap=1.0, collective_sms=16, intra_node_latency_us=8,
                            inter_node_latency_us=25, inter_node_bandwidth_gbps=45, pcie_bandwidth_gbps=50,
                            ring_step_latency_us=3.4, net_step_latency_us=14.0))
_H100 = MappingProxyType(dict(_GPU, name="h100", memory_per_device_gb=80, peak_tflops=989, fp8_peak_tflops=1979,
                              sm_count=132, compute_efficiency=0.7, gemm_half_dim=96, memory_bandwidth_gbps=3350,
                              intra_node_bandwidth_gbps=450))
PROFILES: Mapping[str, Mapping] = MappingProxyType({
    "a100": MappingProxyType(dict(_GPU, name="a100", memory_per_device_gb=80, peak_tflops=312, fp8_peak_tflops=None,
                                  sm_count=108, compute_efficiency=0.8, gemm_half_dim=64, memory_bandwidth_gbps=2039,
                                  intra_node_bandwidth_gbps=230, inter_node_bandwidth_gbps=22,
                                  intra_node_latency_us=10, inter_node_latency_us=30, pcie_bandwidth_gbps=25)),
    "h100": _H100,
    "h200": MappingProxyType(dict(_H100, name="h200", memory_per_device_gb=141, compute_efficiency=0.72,
                                  memory_bandwidth_gbps=4800)),  # H100's compute and links, HBM3e
    "b200": MappingProxyType(dict(_GPU, name="b200", memory_per_device_gb=180, peak_tflops=2250, sm_count=148,
                                  fp8_peak_tflops=4500, compute_efficiency=0.7, gemm_half_dim=128,
                                  memory_bandwidth_gbps=8000, intra_node_bandwidth_gbps=900)),
})
PROFILE_FIELDS = tuple(f.name for f in dataclasses.fields(Hardware) if f.name != "num_devices")


def gemm_efficiency(hardware: Hardware, *dims: float) -> float:
    """Fraction of the peak a GEMM with these dimensions (``m, n, k``) reaches: ``compute_efficiency x d /
    (d + gemm_half_dim)`` for its smallest dimension ``d``."""
    smallest = max(min(dims), 1.0)
    return hardware.compute_efficiency * smallest / (smallest + hardware.gemm_half_dim)


def load_profile(name_or_path: str) -> dict:
    """A profile's fields: a shipped one by name (``a100``, ``h100``, ``h200``, ``b200``) or a JSON file
    (``--calibrate``'s output)."""
    if name_or_path.lower() in PROFILES:
        return dict(PROFILES[name_or_path.lower()])
    if not os.path.isfile(name_or_path):
        raise ValueError(f"hardware profile {name_or_path!r} is neither a shipped profile "
                         f"({', '.join(sorted(PROFILES))}) nor a JSON file: pass one of those names or the file "
                         "that --calibrate wrote")
    with open(name_or_path) as f:
        fields = json.load(f)
    unknown = sorted(set(fields) - set(PROFILE_FIELDS))
    if unknown:
        raise ValueError(f"hardware profile {name_or_path} has unknown fields {unknown}; known: "
                         f"{', '.join(PROFILE_FIELDS)}")
    return fields


def hardware_from_profile(name_or_path: str, *, num_devices: int, **overrides) -> Hardware:
    """A ``Hardware`` of ``num_devices`` devices from a profile, with ``overrides`` (None values ignored)."""
    fields = {**load_profile(name_or_path), **{k: v for k, v in overrides.items() if v is not None}}
    return Hardware(num_devices=num_devices, **fields)


def save_profile(hardware: Hardware, path: str) -> None:
    """Writes ``hardware``'s profile fields (everything but the device count) as JSON, atomically."""
    fields = {name: getattr(hardware, name) for name in PROFILE_FIELDS}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(fields, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


__all__ = ["Hardware", "PROFILES", "PROFILE_FIELDS", "gemm_efficiency", "load_profile", "hardware_from_profile",
           "save_profile"]
