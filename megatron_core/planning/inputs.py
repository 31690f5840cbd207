"""What the planner takes: the workload one step trains, a parallel layout, and the space of layouts a search
may use (``planning.planner`` plans them; ``tools/plan_parallelism.py`` builds them from the flags)."""
from __future__ import annotations

import dataclasses
from typing import Optional

RECOMPUTE_CHOICES = (None, "selective", "full")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """What one step trains, and the numeric formats (the training loop's: fp32 grads, fp32 Adam masters)."""

    vocab_size: int
    seq_length: int
    micro_batch_size: int
    global_batch_size: int
    make_vocab_size_divisible_by: int = 128
    optimizer_state_bytes: int = 8
    """Per parameter: 8 for Adam's two fp32 moments, 4 for SGD momentum."""
    grad_bytes: int = 4
    """Per gradient element: 4 (fp32 main grads, reduced in fp32: the default), 2 with ``--grad-reduce-in-bf16``
    (grads kept and reduced in the 16-bit dtype, as Megatron-Bridge's performance recipes run)."""
    torch_ddp_buckets: bool = False
    """The gradients are reduced by torch's ``DistributedDataParallel`` without ``gradient_as_bucket_view`` (its
    default; Megatron-LM's ``--DDP-impl torch`` of 2021), whose buckets hold a second copy of every replicated
    gradient (the flag's PR, pytorch/pytorch#41954: about 1 GB less peak for a model with about 1 GB of
    parameters): ``grad_bytes`` more per parameter at ZeRO 0-1. Here, as in Megatron-LM's own DDP, the grads are
    views of the buckets."""
    mask_bytes: int = 1
    """Per dropout-mask element: 1 on CUDA, the activation's element size on the CPU."""
    flash_attention: bool = True
    """Core attention without materialized scores (SDPA flash / efficient: the GPU default); False counts the
    ``s^2`` scores' memory traffic (the unfused softmax path, e.g. Megatron-LM before flash attention)."""


def grad_bytes_of(args) -> int:
    """``Workload.grad_bytes`` of a run with these pretrain_gpt.py flags: 2 with ``--grad-reduce-in-bf16`` on a
    16-bit model (the grad buffers then take the parameters' dtype), else 4."""
    return 2 if getattr(args, "grad_reduce_in_bf16", False) and (args.bf16 or args.fp16) else 4


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    vpp: Optional[int]
    zero_stage: int
    sequence_parallel: bool
    recompute: Optional[str]
    cp: int = 1
    """Context-parallel size (the sequence split over cp ranks); devices = tp x cp x dp x pp."""
    ep: int = 1
    """Expert-parallel size (MoE models): ``E / ep`` experts per rank; ep x etp divides tp x cp x dp."""
    etp: int = 1
    """Expert tensor-parallel size (each expert's fc1 / fc2 split over etp consecutive ranks, the tp group or not;
    any size dividing the expert hidden size with ep x etp dividing tp x cp x dp)."""
    zero_bubble: bool = False
    """The zero-bubble pipeline schedule (ZB-H1, ``--zero-bubble``; pp > 1, no vpp)."""
    embedding_loss_split: bool = False
    """The embedding and the loss each count as a layer in the pipeline split (``--account-for-embedding-in-
    pipeline-split --account-for-loss-in-pipeline-split``; ``layout.split_chunk_counts``): the first and last
    model chunks hold one transformer layer fewer. The search uses it where no even split exists (Llama-3.1
    405B's 126 layers on pp 8 x vpp 8, as Megatron-Bridge's recipe)."""
    tp_comm_overlap: bool = False
    """``--tp-comm-overlap``: the sequence-parallel collectives in chunks beside the GEMMs (needs SP)."""

    @property
    def dp_cp(self) -> int:
        """The ranks replicated parameters are reduced (and ZeRO-sharded) over."""
        return self.dp * self.cp

    @property
    def expert_dp(self) -> int:
        """The ranks holding the same experts (expert grads are reduced and ZeRO-sharded over them)."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """The features a layout may use (the planner's ``--zero-stages``, ``--recompute-options``,
    ``--no-sequence-parallel``, ``--max-context-parallel``, ``--zero-bubble``): e.g. what a framework of
    2021 offered, to compare with the layouts its users chose."""

    zero_stages: tuple = (0, 1, 2, 3)
    recompute: tuple = RECOMPUTE_CHOICES
    sequence_parallel: bool = True
    max_cp: Optional[int] = None
    interleaving: bool = True
    zero_bubble: bool = False
    embedding_loss_split: bool = True
    """Where no even pipeline split exists, count the embedding and loss as layers (``Layout.embedding_loss_split``)."""
    tp_comm_overlap: bool = True
    """Sequence-parallel layouts also with ``--tp-comm-overlap``."""


__all__ = ["RECOMPUTE_CHOICES", "Workload", "Layout", "SearchSpace", "grad_bytes_of"]
