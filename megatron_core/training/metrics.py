"""Throughput and model-FLOPs accounting, Megatron-style log lines, a JSON-lines metrics file, TensorBoard."""
from __future__ import annotations

import json
import logging
import os
import resource
import time
from types import MappingProxyType
from typing import Optional, Sequence

import torch

from megatron_core.config import TransformerConfig
from megatron_core.utils import accelerator

logger = logging.getLogger(__name__)
PEAK_TFLOPS_BF16 = MappingProxyType({"B200": 2250.0, "H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0,
                                     "A10": 125.0})
PEAK_TFLOPS_FP8 = MappingProxyType({"B200": 4500.0, "H200": 1979.0, "H100": 1979.0, "L40S": 733.0})
"""Dense FP8 tensor-core peaks (devices without FP8 tensor cores run FP8 emulated: their bf16 peak applies)."""


def gpt_flops_per_iteration(config: TransformerConfig, *, batch_size: int, seq_length: int,
                            padded_vocab_size: int) -> float:
    """Model FLOPs of one training iteration (forward + backward) of a GPT, Megatron-LM's formula:
    ``12 B s L h^2 (q/h (1 + g/a + s/h) + f/h * (3/2 if SwiGLU) + V / (2 L h))`` with q = a * kv_channels."""
    h, layers = config.hidden_size, config.num_layers
    attention = attention_flops_ratio(config, seq_length)
    mlp = mlp_flops_ratio(config)
    depths = config.mtp_num_layers or 0  # multi-token prediction: per depth eh_proj, one layer and the logits
    logits = padded_vocab_size * (1 + depths) / (2 * layers * h)
    mtp = depths * (attention + mlp_flops_ratio(config, moe_layer=True) + 1.0) / layers  # eh_proj 2h -> h: 1
    return 12.0 * batch_size * seq_length * layers * h * h * (attention + mlp + logits + mtp)


def attention_flops_ratio(config: TransformerConfig, seq_length: int) -> float:
    """The formula's attention term: per token and layer, forward matmul FLOPs / ``4 h^2`` (so that x ``12 h^2``
    counts forward + backward). Standard attention: ``q/h (1 + g/a + s/h)``. Multi-latent attention
    (DeepSeek): the q path (``h -> q_lora_rank -> a (d_qk + d_pe)``, or ``h -> a (d_qk + d_pe)``), the kv
    down and up projections (``h -> kv_lora + d_pe -> a (d_qk + d_v)``), the output projection ``a d_v -> h``,
    and the scores and values over s keys (``s a (d_qk + d_pe)``, ``s a d_v``)."""
    h, heads = config.hidden_size, config.num_attention_heads
    if not config.multi_latent_attention:
        query_ratio = config.kv_channels * heads / h
        return (1 + config.num_query_groups / heads + seq_length / h) * query_ratio
    q_dim, v_dim = heads * (config.qk_head_dim + config.qk_pos_emb_head_dim), heads * config.v_head_dim
    rank = config.q_lora_rank
    q = h * q_dim if rank is None else rank * (h + q_dim)
    kv = h * (config.kv_lora_rank + config.qk_pos_emb_head_dim) + config.kv_lora_rank * heads * (
        config.qk_head_dim + config.v_head_dim)
    macs = q + kv + v_dim * h + seq_length * (q_dim + v_dim)  # multiply-adds per token
    return 2.0 * macs / (4.0 * h * h)


def mlp_flops_ratio(config: TransformerConfig, *, moe_layer: Optional[bool] = None) -> float:
    """The formula's MLP term ``f/h (x 3/2 when gated)``, averaged over the layers (or of one MoE / dense layer
    with ``moe_layer``). An MoE layer counts its *active* parameters, as Megatron-LM: ``topk x moe_ffn / h``
    plus the shared expert's ``f_shared / h`` (the router's ``E/h`` share is left out, as there)."""
    gated = 1.5 if config.activation in ("swiglu", "quick_geglu") else 1.0
    dense = config.ffn_hidden_size / config.hidden_size * gated
    moe = config.moe
    if moe is None or moe_layer is False:
        return dense
    expert_ffn = moe.moe_ffn_hidden_size or config.ffn_hidden_size
    active = moe.moe_router_topk * expert_ffn + (moe.moe_shared_expert_intermediate_size or 0)
    sparse = active / config.hidden_size * gated
    if moe_layer:
        return sparse
    moe_layers = sum(moe.is_moe_layer(n, config.num_layers) for n in range(1, config.num_layers + 1))
    return (moe_layers * sparse + (config.num_layers - moe_layers) * dense) / config.num_layers


def _layer_forward_flops(config: TransformerConfig, *, batch_size: int, seq_length: int) -> tuple[float, float]:
    """(whole layer, core attention) forward FLOPs of one layer: a third of the formula's per-layer terms."""
    h = config.hidden_size
    attention = attention_flops_ratio(config, seq_length)
    mlp = mlp_flops_ratio(config)
    per_token = 4.0 * batch_size * seq_length * h * h
    if config.multi_latent_attention:
        core = seq_length * config.num_attention_heads * (config.qk_head_dim + config.qk_pos_emb_head_dim
                                                          + config.v_head_dim) / (2.0 * h * h)
    else:
        core = seq_length / h * config.kv_channels * config.num_attention_heads / h
    return per_token * (attention + mlp), per_token * core


def recomputed_layers_per_chunk(config: TransformerConfig, layers_per_chunk: int) -> int:
    """Layers of one model chunk whose forward full recompute runs again in backward (0 without it)."""
    if config.recompute_granularity != "full":
        return 0
    if config.recompute_method == "uniform":
        return layers_per_chunk
    return min(config.recompute_num_layers, layers_per_chunk)


def recompute_flops_per_iteration(config: TransformerConfig, *, batch_size: int, seq_length: int) -> float:
    """Forward FLOPs spent again in backward by activation recompute (not model FLOPs: MFU leaves them out,
    hardware FLOPs = ``gpt_flops_per_iteration + recompute_flops_per_iteration``).

    Full recompute adds one forward of every recomputed layer ("uniform": all layers; "block": the first
    ``recompute_num_layers`` of each model chunk); selective adds the core-attention forward (``QK^T`` and
    ``softmax V``: ``4 B s^2 a d`` per layer).
    """
    layer, core_attention = _layer_forward_flops(config, batch_size=batch_size, seq_length=seq_length)
    if config.recompute_granularity == "selective":
        return core_attention * config.num_layers
    chunks = config.pipeline_model_parallel_size * (config.virtual_pipeline_model_parallel_size or 1)
    return layer * chunks * recomputed_layers_per_chunk(config, config.num_layers // chunks)


def hardware_flops_per_iteration(config: TransformerConfig, *, batch_size: int, seq_length: int,
                                 padded_vocab_size: int) -> float:
    """Model FLOPs plus the recomputed forward FLOPs: what the device actually executes."""
    return (gpt_flops_per_iteration(config, batch_size=batch_size, seq_length=seq_length,
                                    padded_vocab_size=padded_vocab_size)
            + recompute_flops_per_iteration(config, batch_size=batch_size, seq_length=seq_length))


def mfu(model_flops: float, seconds: float, *, num_devices: int, peak_tflops: Optional[float]) -> Optional[float]:
    """Model-FLOPs utilization: achieved model FLOP/s per device over the device peak (None if unknown)."""
    if not peak_tflops or seconds <= 0:
        return None
    return model_flops / seconds / num_devices / (peak_tflops * 1e12)


def peak_tflops_per_device(device: torch.device, override: Optional[float] = None, *,
                           fp8: bool = False) -> Optional[float]:
    """Dense peak of the device (None when unknown, e.g. a CPU: MFU is then not reported): bf16's, or with
    ``fp8`` the FP8 tensor cores' where the device has them (``--fp8-format`` training's MFU)."""
    if override:
        return override
    if device.type != "cuda":
        return None
    return peak_for_device_name(accelerator.device_name(device), fp8=fp8)


def peak_for_device_name(name: str, *, fp8: bool = False) -> Optional[float]:
    """The table's peak for a device named ``name`` (``NVIDIA H100 80GB HBM3``); None when unknown."""
    tables = (PEAK_TFLOPS_FP8, PEAK_TFLOPS_BF16) if fp8 else (PEAK_TFLOPS_BF16,)
    for table in tables:
        peak = next((value for key, value in table.items() if key in name), None)
        if peak is not None:
            return peak
    return None


def memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory on CUDA; the process's peak resident set on the CPU."""
    if device.type == "cuda":
        return accelerator.max_memory_allocated(device) or 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class MetricsWriter:
    """Appends one JSON object per line (rank 0 only); TensorBoard scalars when a directory is given (a
    warning when the tensorboard package is missing); every record also goes to ``sinks`` (e.g. wandb).

    Args:
        path: the JSON-lines file, or None.
        tensorboard_dir: the TensorBoard log directory, or None.
        enabled: whether this rank writes (the logging rank).
        sinks: objects with ``write(record)`` and ``close()``.
        tensorboard_exclude: record keys not sent to TensorBoard (``--no-log-loss-scale-to-tensorboard``).
    """

    def __init__(self, path: Optional[str], tensorboard_dir: Optional[str], *, enabled: bool,
                 sinks: Sequence = (), tensorboard_exclude: Sequence[str] = ()) -> None:
        self.enabled = enabled
        self.file = open(path, "a", encoding="utf-8") if (path and enabled) else None
        self.sinks = list(sinks)
        self.exclude = {"iteration", *tensorboard_exclude}
        self.tensorboard = None
        if tensorboard_dir and enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                logger.warning("--tensorboard-dir %s: the tensorboard package is not installed (pip install "
                               "tensorboard); not writing TensorBoard logs", tensorboard_dir)
            else:
                self.tensorboard = SummaryWriter(log_dir=tensorboard_dir)

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
            os.fsync(self.file.fileno())
        if self.tensorboard is not None:
            prefix = record.get("split", "train")
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in self.exclude:
                    self.tensorboard.add_scalar(f"{prefix}/{key}", value, record["iteration"])
        if self.enabled:
            for sink in self.sinks:
                sink.write(record)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        for sink in self.sinks:
            sink.close()


def format_log_line(record: dict, *, train_iters: int, consumed_samples: int, global_batch: int) -> str:
    """Megatron's training log line."""
    def fmt(value, spec):
        return "n/a" if value is None else format(value, spec)
    return (f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {record['iteration']:8d}/{train_iters:8d} |"
            f" consumed samples: {consumed_samples:12d} |"
            f" elapsed time per iteration (ms): {record['ms_per_iter']:.1f} |"
            f" learning rate: {record['lr']:.3E} | global batch size: {global_batch:5d} |"
            f" lm loss: {fmt(record['lm_loss'], '.6E')} | loss scale: {record['loss_scale']:.1f} |"
            f" grad norm: {fmt(record['grad_norm'], '.3f')} | number of skipped iterations: {record['skipped']:3d} |"
            f" tokens/s: {record['tokens_per_sec']:.0f} | TFLOP/s/rank: {record['tflops_per_rank']:.3f} |"
            f" MFU: {fmt(record['mfu'], '.2%')} | mem: {record['mem_bytes'] / 2**20:.0f} MiB |"
            + "".join(f" {label}: {format(record[key], spec)} |" for key, label, spec in _OPTIONAL_FIELDS
                      if record.get(key) is not None))


_OPTIONAL_FIELDS = (("params_norm", "params norm", ".3f"), ("num_zeros", "num zeros", ".1f"),
                    ("load_balancing_loss", "load_balancing_loss", ".6E"), ("z_loss", "z_loss", ".6E"))
