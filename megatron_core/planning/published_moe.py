"""Megatron-Bridge's DGX-H100 MoE measurements at their recipes' layouts: not in the planner's validation set.

NVIDIA-NeMo/Megatron-Bridge ``docs/performance-summary-archive.md``, container 26.04.01 (the newest with H100 MoE
rows); the settings are those of the recipe code at the release beside it (``scripts/performance/configs/qwen``
and ``.../gpt_oss``, v0.4.1 / v0.4.2): every MoE benchmark forces balanced routing and drops no tokens
(``--moe-router-force-load-balancing``), the distributed optimizer, bf16 gradient reduction, micro-batch 1,
sequence 4096. FP8 is current scaling (tensorwise) with ``--fp8-param-gather``.

The model's readings of them (``scripts/published_layouts.py`` prints them; docs/performance.md discusses
why none is within 15%) are a record of what it misses on a GPU's MoE layers, not a target it was fitted to.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron_core.config import TransformerConfig
from megatron_core.fp8.config import Fp8Config
from megatron_core.planning.hardware import Hardware, hardware_from_profile
from megatron_core.planning.planner import Layout, Workload, plan_layout
from megatron_core.transformer.moe import MoEConfig

SEQUENCE = 4096


@dataclasses.dataclass(frozen=True)
class BridgeMoERun:
    """One published MoE row: the model's shape, the recipe's layout and what it measured."""

    name: str
    layers: int
    hidden: int
    heads: int
    query_groups: int
    head_dim: int
    experts: int
    topk: int
    expert_ffn: int
    vocab: int
    gpus: int
    global_batch: int
    tp: int
    pp: int
    vpp: Optional[int]
    ep: int
    tokens_per_gpu_second: float
    model_tflops: float
    """Their Model TFLOP/s per GPU (causal attention's ``s^2`` term counted at half)."""
    settings: str
    """The recipe's MoE settings the model does not take (dispatcher, overlap, recompute)."""
    fp8: bool = True
    gpt_oss: bool = False
    """gpt-oss's layers: biases, the clamped quick GeGLU, learned sinks, a 128-token window on alternate layers."""
    embedding_loss_split: bool = False

    def config(self) -> TransformerConfig:
        moe = MoEConfig(num_moe_experts=self.experts, moe_router_topk=self.topk, moe_ffn_hidden_size=self.expert_ffn,
                        moe_token_dispatcher_type="alltoall", moe_router_force_load_balancing=True)
        shape = dict(num_layers=self.layers, hidden_size=self.hidden, num_attention_heads=self.heads,
                     num_query_groups=self.query_groups, kv_channels=self.head_dim, ffn_hidden_size=self.expert_ffn,
                     normalization="RMSNorm", position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                     max_position_embeddings=SEQUENCE, bf16=True, params_dtype=torch.bfloat16, hidden_dropout=0.0,
                     attention_dropout=0.0, moe=moe,
                     fp8=Fp8Config(fp8_recipe="tensorwise", fp8_param_gather=True) if self.fp8 else None)
        if self.gpt_oss:
            return TransformerConfig(**shape, activation="quick_geglu", glu_linear_offset=1.0, add_bias_linear=True,
                                     softmax_type="learnable", window_size=(127, 0), window_attn_skip_freq=2)
        return TransformerConfig(**shape, activation="swiglu", add_bias_linear=False, qk_layernorm=True)

    def workload(self) -> Workload:
        return Workload(vocab_size=self.vocab, seq_length=SEQUENCE, micro_batch_size=1,
                        global_batch_size=self.global_batch, grad_bytes=2)

    def layout(self) -> Layout:
        dp = self.gpus // (self.tp * self.pp)
        return Layout(self.tp, self.pp, dp, self.vpp, 1, self.tp > 1, None, ep=self.ep,
                      embedding_loss_split=self.embedding_loss_split)

    def hardware(self) -> Hardware:
        return hardware_from_profile("h100", num_devices=self.gpus)

    def plan(self):
        """The planner's ``Plan`` at the recipe's layout."""
        return plan_layout(self.config(), self.workload(), self.hardware(), self.layout())

    @property
    def measured_step_seconds(self) -> float:
        return self.global_batch * SEQUENCE / (self.tokens_per_gpu_second * self.gpus)


MEGATRON_BRIDGE_H100_MOE = (
    BridgeMoERun("Qwen3-30B-A3B", 48, 2048, 32, 4, 128, 128, 8, 768, 151936, 16, 1024, 1, 1, None, 16, 8960, 206,
                 "flex dispatcher with HybridEP on 32 SMs, no EP overlap"),
    BridgeMoERun("Qwen3-235B-A22B", 94, 4096, 64, 4, 128, 128, 8, 1536, 151936, 256, 8192, 2, 8, 4, 32, 1712, 253,
                 "all-to-all, EP overlap with delayed wgrad", embedding_loss_split=True),
    BridgeMoERun("GPT-OSS 120B", 36, 2880, 64, 8, 64, 128, 4, 2880, 201088, 64, 1280, 1, 4, None, 8, 5824, 158,
                 "all-to-all, recompute of norms and MoE activations", fp8=False, gpt_oss=True),
)
"""The shapes of their Hugging Face configs (Qwen3: QK-norm, no shared experts, every layer MoE). The benchmark
feeds gpt-oss a 32000-token NullTokenizer's ids; its embedding and output layer keep the model's 201088 rows."""

__all__ = ["BridgeMoERun", "MEGATRON_BRIDGE_H100_MOE"]
