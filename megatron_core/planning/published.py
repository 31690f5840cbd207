"""Layouts that experts chose and measured: the planner's validation set.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC'21,
arXiv 2104.04473), Table 1: ten GPT models from 1.7B to 1T parameters trained by Megatron-LM's authors on
Selene (DGX A100 80 GB, 8 GPUs per node, 8 x HDR InfiniBand per node), sequence 2048, vocabulary 51200, mixed
precision, full activation recompute, achieved TFLOP/s per GPU counted with their formula ``96 B s l h^2
(1 + s / 6h + V / 16 l h)`` (hardware FLOPs: model + recompute, as ``training.metrics``). Not published in the
table and assumed here: micro-batch 1.

What those runs could use is the planner's ``SearchSpace`` for them: ZeRO 0 (no distributed optimizer then),
full recompute, no sequence or context parallelism (both came later), interleaving allowed, and attention
without flash (the softmax's ``s^2`` scores materialized). Their data-parallel all-reduce did not overlap the
backward: Megatron-LM's ``train_step`` of the time called ``allreduce_gradients()`` after the last micro-batch's
backward ("the communication in local DDP doesn't" overlap it, NVIDIA/Megatron-LM#428; ``--overlap-grad-reduce``
came in September 2023, #391), so they are planned on the A100 profile with ``comm_overlap=0``
(``PublishedRun.hardware``).
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_core.config import TransformerConfig
from megatron_core.planning.hardware import Hardware, hardware_from_profile
from megatron_core.planning.planner import Layout, SearchSpace, Workload, plan_layout

NARAYANAN_2021_SPACE = SearchSpace(zero_stages=(0,), recompute=("full",), sequence_parallel=False, max_cp=1)


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    global_batch: int
    tflops_per_gpu: float

    def config(self) -> TransformerConfig:
        return TransformerConfig(num_layers=self.layers, hidden_size=self.hidden, num_attention_heads=self.heads,
                                 max_position_embeddings=2048, params_dtype=torch.bfloat16, bf16=True,
                                 hidden_dropout=0.1, attention_dropout=0.1)

    def workload(self) -> Workload:
        return Workload(vocab_size=51200, seq_length=2048, micro_batch_size=1, global_batch_size=self.global_batch,
                        flash_attention=False)

    def layout(self) -> Layout:
        """The authors' layout: their tp and pp, data parallel over the rest, ZeRO 0, full recompute."""
        return Layout(self.tp, self.pp, self.gpus // (self.tp * self.pp), None, 0, False, "full")

    def hardware(self) -> Hardware:
        """``gpus`` A100s as these runs used them: the gradient all-reduce after the backward, not under it."""
        return hardware_from_profile("a100", num_devices=self.gpus, comm_overlap=0.0)

    def plan(self):
        """The planner's ``Plan`` at the authors' layout on ``gpus`` A100s."""
        return plan_layout(self.config(), self.workload(), self.hardware(), self.layout())


NARAYANAN_2021 = (
    PublishedRun("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    PublishedRun("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    PublishedRun("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    PublishedRun("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    PublishedRun("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    PublishedRun("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    PublishedRun("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    PublishedRun("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    PublishedRun("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    PublishedRun("1T", 160, 25600, 128, 8, 64, 3072, 3072, 163),
)

LLAMA3_8B_FP8_TFLOPS_PER_H100 = 744.0
"""Megatron-Bridge's published performance of Llama-3 8B in FP8 (current scaling) on 8 H100s: sequence 8192,
global batch 128, micro-batch 1, tp 1, pp 1, cp 2, distributed optimizer (the figure issue 32 quotes)."""


def llama3_8b_fp8_plan(fp8=True):
    """The planner's ``Plan`` of Llama-3 8B at Megatron-Bridge's layout on 8 H100s (tp 1, pp 1, dp 4, cp 2,
    distributed optimizer; sequence 8192, global batch 128), in FP8 (tensorwise) or, with ``fp8=False``, bf16."""
    from megatron_core.fp8.config import Fp8Config
    workload = Workload(vocab_size=128256, seq_length=8192, micro_batch_size=1, global_batch_size=128)
    return plan_layout(llama3_8b(Fp8Config(fp8_recipe="tensorwise") if fp8 else None), workload,
                       hardware_from_profile("h100", num_devices=8), Layout(1, 1, 4, None, 1, False, None, 2))


def llama3_8b(fp8) -> TransformerConfig:
    """Llama-3 8B's shape (32 layers, hidden 4096, 32 heads in 8 groups, SwiGLU 14336, RMSNorm, rope, untied)."""
    return TransformerConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                             ffn_hidden_size=14336, activation="swiglu", normalization="RMSNorm",
                             position_embedding_type="rope", add_bias_linear=False,
                             untie_embeddings_and_output_weights=True, max_position_embeddings=8192, bf16=True,
                             params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0, fp8=fp8)


__all__ = ["PublishedRun", "NARAYANAN_2021", "NARAYANAN_2021_SPACE", "LLAMA3_8B_FP8_TFLOPS_PER_H100", "llama3_8b",
           "llama3_8b_fp8_plan"]
