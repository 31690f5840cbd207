"""Layouts that experts chose and measured: the planner's validation set.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC'21,
arXiv 2104.04473), Table 1: ten GPT models from 1.7B to 1T parameters trained by Megatron-LM's authors on
Selene (DGX A100 80 GB, 8 GPUs per node, 8 x HDR InfiniBand per node), sequence 2048, vocabulary 51200,
achieved TFLOP/s per GPU counted with their formula ``96 B s l h^2 (1 + s / 6h + V / 16 l h)`` (hardware FLOPs:
model + recompute, as ``training.metrics``). The rest of each run is the authors' own script for that table,
``examples/sc21/run_table_1.sh`` with ``CONFIG.sh`` in NVIDIA/Megatron-LM (for Megatron-LM commit 6985e58938):
``--fp16`` (16-bit grads: no ``--accumulate-allreduce-grads-in-fp32``), full recompute of every layer
(``--activations-checkpoint-method uniform``), the micro-batch size (16 for 1.7B-7.5B, 8, 4, 2, 2, then 1), the
interleaving (``--num-layers-per-virtual-pipeline-stage``: vpp 3, 2, 2 and 3 for 76B-530B) and the
data-parallel implementation: ``--DDP-impl torch`` for 1.7B-18B, ``local`` from 39B on.

What those runs could use is the planner's ``SearchSpace`` for them: ZeRO 0 (no distributed optimizer then),
full recompute, no sequence or context parallelism (both came later), an even pipeline split (counting the
embedding and loss as layers came later too), interleaving allowed, and attention without flash (the
softmax's ``s^2`` scores materialized). How their gradients were reduced depends on the implementation
(``PublishedRun.workload`` and ``.hardware``): torch's ``DistributedDataParallel`` reduces buckets during the
last micro-batch's backward (Megatron-LM's schedule wraps the others in its ``no_sync``) and holds its own copy
of the grads in those buckets; Megatron-LM's local DDP of the time all-reduced them after the last
micro-batch's backward (``allreduce_gradients()`` in ``train_step``: "the communication in local DDP doesn't"
overlap it, NVIDIA/Megatron-LM#428; ``--overlap-grad-reduce`` came in September 2023, #391).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron_core.config import TransformerConfig
from megatron_core.fp8.config import Fp8Config
from megatron_core.planning.hardware import Hardware, hardware_from_profile
from megatron_core.planning.planner import Layout, SearchSpace, Workload, plan_layout

NARAYANAN_2021_SPACE = SearchSpace(zero_stages=(0,), recompute=("full",), sequence_parallel=False, max_cp=1,
                                   embedding_loss_split=False, tp_comm_overlap=False)


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
    micro_batch: int
    ddp: str
    """``--DDP-impl``: ``torch`` (reduced during the last micro-batch's backward) or ``local`` (after it)."""
    vpp: Optional[int] = None

    def config(self) -> TransformerConfig:
        return TransformerConfig(num_layers=self.layers, hidden_size=self.hidden, num_attention_heads=self.heads,
                                 max_position_embeddings=2048, params_dtype=torch.float16, fp16=True,
                                 hidden_dropout=0.1, attention_dropout=0.1)

    def workload(self) -> Workload:
        """Their batch, fp16 grads, and torch DDP's own grad buckets where they used it."""
        return Workload(vocab_size=51200, seq_length=2048, micro_batch_size=self.micro_batch,
                        global_batch_size=self.global_batch, flash_attention=False, grad_bytes=2,
                        torch_ddp_buckets=self.ddp == "torch")

    def layout(self) -> Layout:
        """The authors' layout: their tp, pp and vpp, data parallel over the rest, ZeRO 0, full recompute."""
        return Layout(self.tp, self.pp, self.gpus // (self.tp * self.pp), self.vpp, 0, False, "full")

    def hardware(self) -> Hardware:
        """``gpus`` A100s as these runs used them: torch DDP's reduction under the last micro-batch's backward,
        local DDP's after it (nothing of it hidden)."""
        return hardware_from_profile("a100", num_devices=self.gpus, comm_overlap=1.0 if self.ddp == "torch" else 0.0)

    def plan(self):
        """The planner's ``Plan`` at the authors' layout on ``gpus`` A100s."""
        return plan_layout(self.config(), self.workload(), self.hardware(), self.layout())


NARAYANAN_2021 = (  # Table 1; micro-batch, DDP and vpp from examples/sc21/run_table_1.sh
    PublishedRun("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 16, "torch"),
    PublishedRun("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 16, "torch"),
    PublishedRun("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 16, "torch"),
    PublishedRun("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, 8, "torch"),
    PublishedRun("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, 4, "local"),
    PublishedRun("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, "local", vpp=3),
    PublishedRun("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, "local", vpp=2),
    PublishedRun("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, "local", vpp=2),
    PublishedRun("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, "local", vpp=3),
    PublishedRun("1T", 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, "local"),
)

LLAMA3_8B_FP8_TFLOPS_PER_H100 = 744.0
"""Megatron-Bridge's published Model TFLOP/s per GPU of Llama-3 8B in FP8 (current scaling) on 8 H100s (the
figure issue 32 quotes): ``MEGATRON_BRIDGE_H100[0]``, whose tokens per second the planner is checked against."""


@dataclasses.dataclass(frozen=True)
class BridgeRun:
    """A Megatron-Bridge performance recipe and what it measured (``docs/performance-summary-archive.md``
    of NVIDIA-NeMo/Megatron-Bridge; the layout from its table and ``perf_recipes/llama/<system>``): Llama-3 in
    FP8 current scaling (``--fp8-format hybrid --fp8-recipe tensorwise --fp8-param-gather``, no bf16 first/last
    layers), sequence 8192, the distributed optimizer, bf16 gradient reduction, on ``system`` (a planner
    profile: DGX-H100 or DGX-B200, 8 GPUs per node).

    The check is on step time, from the published tokens per second per GPU: ``global_batch * 8192 / (tokens
    x gpus)``, which no FLOPs formula enters (Megatron-Bridge's Model TFLOP/s count causal attention at half
    the ``s^2`` term, the 2021 papers at all of it). At tp > 1 they overlap the sequence-parallel collectives
    with the GEMMs (``tp_comm_overlap``; Transformer Engine's userbuffers there, chunked async collectives
    here), and so does the layout here."""

    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    gpus: int
    global_batch: int
    tp: int
    pp: int
    cp: int
    vpp: Optional[int]
    tokens_per_gpu_second: float
    model_tflops: float
    container: str
    recompute_block_layers: Optional[int] = None
    """Full recompute of the first n layers of each chunk (``--recompute-method block``), or none."""
    embedding_loss_split: bool = False
    """The embedding and the loss take a layer's place in the pipeline split
    (``--account-for-embedding/loss-in-pipeline-split``)."""
    micro_batch: int = 1
    system: str = "h100"

    def config(self, fp8: bool = True) -> TransformerConfig:
        recompute = {} if self.recompute_block_layers is None else dict(
            recompute_granularity="full", recompute_method="block", recompute_num_layers=self.recompute_block_layers)
        fp8_config = Fp8Config(fp8_recipe="tensorwise", fp8_param_gather=True) if fp8 else None
        return dataclasses.replace(llama3(self.layers, self.hidden, self.heads, self.ffn, fp8_config), **recompute)

    def workload(self) -> Workload:
        return Workload(vocab_size=128256, seq_length=8192, micro_batch_size=self.micro_batch,
                        global_batch_size=self.global_batch, grad_bytes=2)

    def layout(self) -> Layout:
        dp = self.gpus // (self.tp * self.pp * self.cp)
        return Layout(self.tp, self.pp, dp, self.vpp, 1, self.tp > 1, None, self.cp,
                      embedding_loss_split=self.embedding_loss_split, tp_comm_overlap=self.tp > 1)

    def hardware(self) -> Hardware:
        return hardware_from_profile(self.system, num_devices=self.gpus)

    def plan(self, fp8: bool = True):
        """The planner's ``Plan`` at the recipe's layout (``fp8=False``: the same in bf16)."""
        return plan_layout(self.config(fp8), self.workload(), self.hardware(), self.layout())

    @property
    def measured_step_seconds(self) -> float:
        return self.global_batch * 8192 / (self.tokens_per_gpu_second * self.gpus)


MEGATRON_BRIDGE_H100 = (
    BridgeRun("Llama-3 8B", 32, 4096, 32, 14336, 8, 128, 1, 1, 1, None, 14451, 744, "25.11",
              recompute_block_layers=5),
    BridgeRun("Llama-3 70B", 80, 8192, 64, 28672, 64, 256, 4, 8, 1, 5, 1664, 731, "26.04.01"),
    BridgeRun("Llama-3.1 405B", 126, 16384, 128, 53248, 1024, 1536, 8, 8, 2, 8, 328, 827, "26.04.01",
              embedding_loss_split=True),
)

MEGATRON_BRIDGE_B200 = (
    BridgeRun("Llama-3 8B", 32, 4096, 32, 14336, 8, 128, 1, 1, 1, None, 30624, 1576, "25.11", micro_batch=2,
              system="b200"),
    BridgeRun("Llama-3.1 405B", 126, 16384, 128, 53248, 128, 64, 4, 8, 2, 8, 661, 1667, "25.11",
              embedding_loss_split=True, system="b200"),
)
"""The dense rows Megatron-Bridge published for DGX-B200 (container 25.11, the newest with B200 dense rows; FP8
current scaling): 8B on 8 GPUs at micro-batch 2 without recompute, 405B on 128 GPUs at tp 4 pp 8 cp 2 vpp 8."""

MEGATRON_BRIDGE = MEGATRON_BRIDGE_H100 + MEGATRON_BRIDGE_B200
"""Each published recipe once, at its newest measurement: the modern validation set (docs/performance.md)."""


def llama3_8b_fp8_plan(fp8=True):
    """The planner's ``Plan`` of Llama-3 8B at Megatron-Bridge's FP8 recipe on 8 H100s (tp 1, pp 1, dp 8,
    distributed optimizer, full recompute of 5 layers; sequence 8192, global batch 128), in FP8 (tensorwise)
    or, with ``fp8=False``, bf16."""
    return MEGATRON_BRIDGE_H100[0].plan(fp8)


def llama3_8b(fp8) -> TransformerConfig:
    """Llama-3 8B's shape (32 layers, hidden 4096, 32 heads in 8 groups, SwiGLU 14336, RMSNorm, rope, untied)."""
    return llama3(32, 4096, 32, 14336, fp8)


def llama3(layers: int, hidden: int, heads: int, ffn: int, fp8) -> TransformerConfig:
    """A Llama-3 shape (8 query groups, SwiGLU, RMSNorm, rope, untied embeddings, bf16) with ``fp8`` (an
    ``Fp8Config`` or None)."""
    return TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=8,
                             ffn_hidden_size=ffn, activation="swiglu", normalization="RMSNorm",
                             position_embedding_type="rope", add_bias_linear=False,
                             untie_embeddings_and_output_weights=True, max_position_embeddings=8192, bf16=True,
                             params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0, fp8=fp8)


__all__ = ["PublishedRun", "NARAYANAN_2021", "NARAYANAN_2021_SPACE", "LLAMA3_8B_FP8_TFLOPS_PER_H100", "llama3_8b",
           "llama3_8b_fp8_plan", "llama3", "BridgeRun", "MEGATRON_BRIDGE_H100", "MEGATRON_BRIDGE_B200",
           "MEGATRON_BRIDGE"]
