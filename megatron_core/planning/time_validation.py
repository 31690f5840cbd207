"""Predicted against measured step time on this machine: the planner with a calibrated profile
(``planning.calibrate``) against real training steps (``planning.measure.measure_layout``) at layouts of every
axis: tp (with and without SP, SP with ``--tp-comm-overlap``), pp (1F1B and interleaved), cp, ep, dp x ZeRO
1-3, selective and full recompute. Used by ``tests/distributed/test_planner_time.py`` and
``scripts/benchmark.py --only planner``.

The model is large enough for its GEMMs and element-wise ops to matter on a CPU (hidden 256, 256 tokens per
sequence) and small enough for a step to take about half a second; every layout on 2 ranks, one per core, one
thread each: the calibration's conditions (two ranks measuring at once share the memory system). In bf16, or
in fp32 on a CPU without bf16 instructions (``calibrate.fastest_cpu_dtype``), the calibration's dtype.
"""
from __future__ import annotations

import statistics
from types import MappingProxyType
from typing import Callable

import torch

from megatron_core.config import TransformerConfig
from megatron_core.planning.hardware import Hardware
from megatron_core.planning.measure import measure_layout
from megatron_core.planning.planner import Layout, Workload, plan_layout
from megatron_core.transformer.moe.config import MoEConfig

S, B, V, M = 256, 2, 1024, 4
MODEL = MappingProxyType(dict(num_layers=4, hidden_size=256, num_attention_heads=4, hidden_dropout=0.1,
                              attention_dropout=0.1))
MOE = MappingProxyType(dict(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                            moe_aux_loss_coeff=0.0))

LAYOUTS = MappingProxyType({  # name: (layout, MoE)
    "dp 2": (Layout(1, 1, 2, None, 0, False, None), False),
    "dp 2 full recompute": (Layout(1, 1, 2, None, 0, False, "full"), False),
    "tp 2": (Layout(2, 1, 1, None, 0, False, None), False),
    "tp 2 SP": (Layout(2, 1, 1, None, 0, True, None), False),
    "tp 2 SP overlap": (Layout(2, 1, 1, None, 0, True, None, tp_comm_overlap=True), False),
    "pp 2": (Layout(1, 2, 1, None, 0, False, None), False),
    "pp 2 vpp 2": (Layout(1, 2, 1, 2, 0, False, None), False),
    "cp 2": (Layout(1, 1, 1, None, 0, False, None, 2), False),
    "dp 2 ZeRO-1": (Layout(1, 1, 2, None, 1, False, None), False),
    "dp 2 ZeRO-3": (Layout(1, 1, 2, None, 3, False, None), False),
    "MoE ep 2": (Layout(1, 1, 2, None, 1, False, None, 1, 2), True),
})


def _model(layout: Layout, moe: bool) -> dict:
    model = {**MODEL, "sequence_parallel": layout.sequence_parallel, "recompute_granularity": layout.recompute,
             "tp_comm_overlap": layout.tp_comm_overlap}
    if layout.recompute == "full":
        model.update(recompute_method="uniform", recompute_num_layers=1)
    if moe:
        model["moe"] = MoEConfig(**MOE)
    return model


def _measure(layout: Layout, model: dict, steps: int, dtype_name: str) -> float:
    result = measure_layout(model, tp=layout.tp, pp=layout.pp, zero_stage=layout.zero_stage, vocab_size=V,
                            seq_length=S, micro_batch_size=B, num_microbatches=M, vpp=layout.vpp, steps=steps,
                            cp=layout.cp, ep=layout.ep, etp=layout.etp, track_activations=False,
                            dtype=getattr(torch, dtype_name))
    return result.step_seconds


def measured_seconds(distributed: Callable, layout: Layout, moe: bool, *, rounds: int = 3,
                     dtype_name: str = "bfloat16") -> float:
    """The median over ``rounds`` of the slowest rank's last step (of 2: the first warms up); the calibration
    takes median timings too."""
    ranks = layout.tp * layout.pp * layout.dp * layout.cp
    return statistics.median(max(distributed(ranks, _measure, layout, _model(layout, moe), 2, dtype_name))
                             for _ in range(rounds))


def predicted_seconds(layout: Layout, moe: bool, profile: dict, dtype_name: str = "bfloat16") -> float:
    """The planner's step time at ``layout`` with the calibrated ``profile`` (CPU attention: scores
    materialized; CPU dropout masks: one activation element each)."""
    model = _model(layout, moe)
    dtype = getattr(torch, dtype_name)
    base = TransformerConfig(**{k: v for k, v in model.items() if k not in ("sequence_parallel", "tp_comm_overlap")},
                             max_position_embeddings=S, params_dtype=dtype, bf16=dtype == torch.bfloat16)
    workload = Workload(vocab_size=V, seq_length=S, micro_batch_size=B, global_batch_size=B * M * layout.dp,
                        make_vocab_size_divisible_by=8, mask_bytes=dtype.itemsize, flash_attention=False)
    ranks = layout.tp * layout.pp * layout.dp * layout.cp
    hardware = Hardware(num_devices=ranks, **{**profile, "devices_per_node": max(ranks, 1)})
    return plan_layout(base, workload, hardware, layout).step_seconds


def validate(distributed: Callable, profile: dict, names=None, rounds: int = 3,
             dtype_name: str = "bfloat16") -> list[tuple[str, float, float]]:
    """(name, predicted, measured) seconds per step for each validated layout, in ``dtype_name`` (the
    calibration's)."""
    rows = []
    for name, (layout, moe) in LAYOUTS.items():
        if names is None or name in names:
            rows.append((name, predicted_seconds(layout, moe, profile, dtype_name),
                         measured_seconds(distributed, layout, moe, rounds=rounds, dtype_name=dtype_name)))
    return rows


__all__ = ["LAYOUTS", "MODEL", "measured_seconds", "predicted_seconds", "validate"]
