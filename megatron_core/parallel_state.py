"""The parallel layout: one immutable object with the sizes, ranks and process groups of every axis.

Ranks are laid out on a grid ``torch.arange(world_size).view(pp, dp, cp, tp)``: tensor parallel (tp) is the
fastest-varying axis, then context parallel (cp), data parallel (dp) and pipeline parallel (pp), Megatron's
default order ``tp-cp-dp-pp``::

    global_rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

Example: world size 8 with tp=2, pp=2, dp=2 (cp=1) gives these groups (every rank belongs to exactly one
group of each kind)::

    tp groups:        [0, 1] [2, 3] [4, 5] [6, 7]
    cp groups:        [0] [1] [2] [3] [4] [5] [6] [7]
    dp groups:        [0, 2] [1, 3] [4, 6] [5, 7]
    dp x cp groups:   [0, 2] [1, 3] [4, 6] [5, 7]
    tp x cp groups:   [0, 1] [2, 3] [4, 5] [6, 7]    (the ranks splitting one sequence under tp SP x cp)
    pp groups:        [0, 4] [1, 5] [2, 6] [3, 7]
    model-parallel:   [0, 1, 4, 5] [2, 3, 6, 7]      (tp x pp: the ranks holding one model replica)
    embedding groups: [0, 4] [1, 5] [2, 6] [3, 7]    (first and last stage of each pipeline)

Stage 0 holds ranks 0-3, stage 1 ranks 4-7; the tp pairs of adjacent ranks share a node in a real cluster.

Expert parallelism (ep, for mixture-of-experts layers) is a second view of each pipeline stage's ``tp x cp x
dp`` ranks: ``torch.arange(world).view(pp, expert_dp, ep)``, ep fastest, so ``ep`` must divide
``tp * cp * dp``. An ep group holds different experts (tokens move between its ranks by all-to-all); an
expert-dp group holds the same experts, and their gradients are reduced over it (experts are not split over
tp: expert tensor parallelism is 1, so expert-dp also spans the tp ranks that ep does not). World size 8 with
tp=2, pp=2, dp=2 and ep=2::

    ep groups:         [0, 1] [2, 3] [4, 5] [6, 7]
    expert-dp groups:  [0, 2] [1, 3] [4, 6] [5, 7]
    expert-mp groups:  [0, 1, 4, 5] [2, 3, 6, 7]    (ep x pp: one copy of every expert of every stage)

Expert tensor parallelism (etp, any size with ep x etp dividing ``tp * cp * dp``, as Megatron-LM) splits each
expert over an etp group: the expert grid becomes ``view(pp, expert_dp, ep, etp)``, etp fastest, so the etp
groups are blocks of etp consecutive ranks (the tp groups when etp = tp), ep groups stride etp and expert-mp
groups (ep x etp x pp) hold one copy of every expert. The expert grid is independent of the dense one: an etp
group may be part of a tp group (etp < tp), span several (etp > tp) or span dp ranks (tp 1). World size 8,
tp=2, dp=4, ep=2, etp=2 (= tp)::

    etp groups:        [0, 1] [2, 3] [4, 5] [6, 7]    (the tp groups)
    ep groups:         [0, 2] [1, 3] [4, 6] [5, 7]
    expert-dp groups:  [0, 4] [1, 5] [2, 6] [3, 7]
    expert-mp groups:  [0, 1, 2, 3] [4, 5, 6, 7]

World size 8, tp=4, dp=2, ep=2, etp=2 (each tp group [0, 1, 2, 3] [4, 5, 6, 7] holds two etp groups)::

    etp groups:        [0, 1] [2, 3] [4, 5] [6, 7]
    ep groups:         [0, 2] [1, 3] [4, 6] [5, 7]
    expert-dp groups:  [0, 4] [1, 5] [2, 6] [3, 7]
    expert-mp groups:  [0, 1, 2, 3] [4, 5, 6, 7]

and at tp=1, dp=8, ep=2, etp=4 the etp groups [0, 1, 2, 3] [4, 5, 6, 7] span dp ranks (ep groups [0, 4] [1, 5]
[2, 6] [3, 7], no expert-dp group: every rank's expert shard is unique).

Hierarchical context parallelism (``cp_comm_type`` "a2a+p2p", Megatron-LM's
``--hierarchical-context-parallel-sizes a p``, ``a x p = cp``) cuts every cp group into levels: level 0 groups
``a`` consecutive ranks of the cp group (the all-to-all, on the fast intra-node link), level 1 the ranks ``a``
apart (the p2p ring, across nodes). A cp group ``[0, 1, 2, 3]`` with sizes ``(2, 2)``::

    level 0 (a2a):  [0, 1] [2, 3]
    level 1 (p2p):  [0, 2] [1, 3]

A partial distributed optimizer (Megatron-LM's ``--num-distributed-optimizer-instances N``) cuts every dp x cp
group into N instances of ``dp * cp / N`` consecutive ranks. Each instance holds one full copy of the ZeRO-sharded
optimizer state, sharded over the instance (Megatron's "intra partial data parallel group"); the ranks at the
same position of every instance form the inter-instance group (Megatron's "inter distributed optimizer instance
group"): grads are reduce-scattered within the instance, the shards all-reduced across instances, updated
parameters all-gathered within the instance. Experts do the same over their expert-dp group (Megatron's intra
partial expert-dp group; N must divide expert-dp too), and their inter-instance groups are the dense ones (the
expert grid puts an instance ``tp * cp * dp / N`` ranks further on as well). World size 8, tp=2, dp=4, N=2::

    dp x cp groups:          [0, 2, 4, 6] [1, 3, 5, 7]
    intra-instance groups:   [0, 2] [4, 6] [1, 3] [5, 7]    (the optimizer state is sharded over these)
    inter-instance groups:   [0, 4] [2, 6] [1, 5] [3, 7]    (the grad shards are all-reduced over these)

Nothing in megatron_core reads a global to find its group: the ``ParallelState`` returned here is passed to
the layers, schedules and optimizers that need it, so two layouts can live in one process.
"""
from __future__ import annotations

import dataclasses
import datetime
import itertools
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_core.parallel_groups import (  # re-exported: the rank lists of every group, no process group needed
    check_hierarchical_sizes,
    distributed_optimizer_groups,
    hierarchical_groups,
    layout_groups,
    rank_grid,  # noqa: F401 (part of this module's API)
    validate_sizes,
)
from megatron_core.utils import accelerator

ProcessGroup = dist.ProcessGroup

_EXPERT_KINDS = ("etp", "ep", "expert_dp", "expert_mp")


@dataclasses.dataclass(frozen=True)
class ParallelState:
    """Sizes, ranks and process groups of one parallel layout (frozen: build a new one to change it).

    Groups are ``None`` in a single-process state built without ``torch.distributed`` (collectives in
    megatron_core treat a ``None`` group, like a group of size 1, as "no parallelism on this axis"), and
    ``embedding_group`` is None on the middle stages of a pipeline, which hold no embedding.
    Ranks in ``*_ranks`` tuples are global ranks, ordered by their rank inside the group.
    """

    world_size: int
    rank: int
    backend: Optional[str]
    device: torch.device
    tp_size: int
    tp_rank: int
    tp_group: Optional[ProcessGroup]
    tp_ranks: tuple[int, ...]
    cp_size: int
    cp_rank: int
    cp_group: Optional[ProcessGroup]
    cp_ranks: tuple[int, ...]
    dp_size: int
    dp_rank: int
    dp_group: Optional[ProcessGroup]
    dp_ranks: tuple[int, ...]
    dp_cp_group: Optional[ProcessGroup]
    """Data and context parallel ranks together: gradients of a replica are reduced over this group."""
    dp_cp_ranks: tuple[int, ...]
    tp_cp_group: Optional[ProcessGroup] = dataclasses.field(default=None, kw_only=True)
    """Tensor and context parallel ranks together: with sequence parallelism they hold the parts of one
    micro-batch's sequences (the MoE router's aux-loss token counts are summed over this group)."""
    tp_cp_ranks: tuple[int, ...] = dataclasses.field(default=(0,), kw_only=True)
    pp_size: int
    pp_rank: int
    pp_group: Optional[ProcessGroup]
    pp_ranks: tuple[int, ...]
    vpp_size: Optional[int]
    """Model chunks per pipeline rank for the interleaved schedule; None without interleaving."""
    mp_group: Optional[ProcessGroup]
    """tp x pp ranks holding one model replica (grad-norm and inf checks reduce over it)."""
    mp_ranks: tuple[int, ...]
    embedding_group: Optional[ProcessGroup]
    """First and last stage of this rank's pipeline (tied embedding grads are summed over it); None on
    middle stages, whose ``embedding_ranks`` still name their pipeline's ends."""
    embedding_ranks: tuple[int, ...]
    ep_size: int = 1
    """Expert-parallel size: each rank of an ep group holds ``num_experts / ep`` different experts."""
    ep_rank: int = 0
    ep_group: Optional[ProcessGroup] = None
    ep_ranks: tuple[int, ...] = (0,)
    expert_dp_size: int = 1
    """``tp * cp * dp / ep`` ranks holding the same experts (expert gradients are reduced over them)."""
    expert_dp_rank: int = 0
    expert_dp_group: Optional[ProcessGroup] = None
    expert_dp_ranks: tuple[int, ...] = (0,)
    expert_mp_group: Optional[ProcessGroup] = None
    """ep x etp x pp ranks holding one copy of every expert (expert grad norms are summed over it)."""
    expert_mp_ranks: tuple[int, ...] = (0,)
    hierarchical_cp_sizes: Optional[tuple[int, ...]] = None
    """Sizes of the levels of each cp group (product cp; innermost first), or None without hierarchical cp."""
    hierarchical_cp_groups: tuple[Optional[ProcessGroup], ...] = ()
    """This rank's group at each level (None for a level of size 1); see the module docstring."""
    hierarchical_cp_ranks: tuple[tuple[int, ...], ...] = ()
    """Global ranks of each level's group, in group-rank order."""
    etp_size: int = 1
    """Expert tensor-parallel size: 1 (whole experts) or more (each expert's fc1 rows / fc2 columns split over
    the etp group; any size with ep x etp dividing tp x cp x dp)."""
    etp_rank: int = 0
    etp_group: Optional[ProcessGroup] = None
    """The ranks splitting the same experts (the last axis of the expert grid; the tp group itself when etp = tp;
    None at etp 1): MoE tokens are all-gathered over it before dispatch and partial outputs reduce-scattered."""
    etp_ranks: tuple[int, ...] = (0,)
    num_distributed_optimizer_instances: int = 1
    """Megatron's ``--num-distributed-optimizer-instances``: optimizer instances the dp x cp ranks are cut into,
    each holding one full copy of the ZeRO-sharded state (module docstring). The groups below exist when > 1."""
    intra_dp_cp_group: Optional[ProcessGroup] = None
    """The ``dp * cp / N`` consecutive dp x cp ranks of this rank's instance (Megatron's intra partial data parallel
    group with cp): ZeRO shards dense parameters over it. None with one instance (use ``dp_cp_group``)."""
    intra_dp_cp_ranks: tuple[int, ...] = ()
    intra_expert_dp_group: Optional[ProcessGroup] = None
    """The expert-dp ranks of this rank's instance (Megatron's intra partial expert data parallel group): expert
    parameters are sharded over it. None with one instance (use ``expert_dp_group``)."""
    intra_expert_dp_ranks: tuple[int, ...] = ()
    inter_dist_opt_group: Optional[ProcessGroup] = None
    """The ranks at this rank's position in every instance (Megatron's inter distributed optimizer instance group,
    for dense and expert parameters alike): the reduce-scattered grad shards are all-reduced over it."""
    inter_dist_opt_ranks: tuple[int, ...] = ()

    rng_tracker: Any = dataclasses.field(default=None, compare=False, repr=False)
    """This layout's ``RNGStatesTracker`` (the tensor-parallel dropout stream; seeded by ``model_parallel_seed``).
    Modules built with the state use it; created with the state, on its device."""

    schedule_calls: Iterator[int] = dataclasses.field(default_factory=itertools.count, compare=False, repr=False)
    """Counts the pipeline schedules run with this layout (every rank runs the same sequence, so the count names
    the same call on every rank: the store key a failing rank publishes its error under)."""
    abandoned_transfers: list = dataclasses.field(default_factory=list, compare=False, repr=False)
    """Point-to-point transfers of a failed schedule, never waited for (a peer may be gone): kept alive so that
    their sends can still go out."""
    kernel_backend: Any = dataclasses.field(default=None, compare=False, repr=False)
    """The ``kernels.KernelBackend`` the modules built with this state run their fused ops through (mode "auto"
    unless ``initialize_model_parallel(kernel_backend=...)`` says otherwise); ``kernel_backend.report()`` says
    which implementation each op ran."""

    weight_grad_store: Any = dataclasses.field(default=None, compare=False, repr=False)
    """The ``WeightGradStore`` of the linears built with this state: the zero-bubble schedule defers their
    weight-gradient GEMMs into it (created with the state)."""

    def __post_init__(self) -> None:
        if self.weight_grad_store is None:
            from megatron_core.tensor_parallel.weight_grad_store import WeightGradStore
            object.__setattr__(self, "weight_grad_store", WeightGradStore())
        if self.kernel_backend is None or isinstance(self.kernel_backend, str):
            import kernels
            object.__setattr__(self, "kernel_backend", kernels.KernelBackend(self.kernel_backend or "auto"))
        if self.rng_tracker is None:
            from megatron_core.tensor_parallel.random import RNGStatesTracker
            object.__setattr__(self, "rng_tracker", RNGStatesTracker(self.device))

    @property
    def dp_cp_size(self) -> int:
        return self.dp_size * self.cp_size

    @property
    def dp_cp_rank(self) -> int:
        return self.dp_cp_ranks.index(self.rank)

    @property
    def mp_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_pipeline_first_stage(self) -> bool:
        """True on pipeline rank 0 (whatever model chunk runs there; see ``is_first_model_chunk``)."""
        return self.pp_rank == 0

    @property
    def is_pipeline_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def is_first_model_chunk(self, vp_stage: int) -> bool:
        """Whether model chunk ``vp_stage`` of this rank is the first chunk of the whole model."""
        return self.is_pipeline_first_stage and vp_stage == 0

    def is_last_model_chunk(self, vp_stage: int) -> bool:
        """Whether model chunk ``vp_stage`` of this rank is the last chunk of the whole model."""
        return self.is_pipeline_last_stage and vp_stage == (self.vpp_size or 1) - 1

    @property
    def next_pipeline_rank(self) -> int:
        """Global rank of the next pipeline stage (wraps around, as the interleaved schedule needs)."""
        return self.pp_ranks[(self.pp_rank + 1) % self.pp_size]

    @property
    def prev_pipeline_rank(self) -> int:
        """Global rank of the previous pipeline stage (wraps around)."""
        return self.pp_ranks[(self.pp_rank - 1) % self.pp_size]

    @property
    def is_in_embedding_group(self) -> bool:
        return self.rank in self.embedding_ranks

    @property
    def tp_src_rank(self) -> int:
        """Global rank of tp rank 0 in this rank's tp group (the source when broadcasting a batch)."""
        return self.tp_ranks[0]

    def describe(self) -> str:
        """The layout in one line, e.g. ``tp 2 x cp 1 x pp 2 (vpp 2) x dp 2, ep 1 (world 8)``."""
        vpp = f" (vpp {self.vpp_size})" if self.vpp_size else ""
        ep = f", ep {self.ep_size} x expert-dp {self.expert_dp_size}" if self.ep_size > 1 else ""
        ep += f", etp {self.etp_size}" if self.etp_size > 1 else ""
        return (f"tp {self.tp_size} x cp {self.cp_size} x pp {self.pp_size}{vpp} x dp {self.dp_size}{ep} "
                f"(world {self.world_size})")


def _device_for_backend(backend: Optional[str]) -> torch.device:
    if accelerator.is_device_backend(backend):  # nccl (or a dry run's fake backend) moves CUDA tensors
        return torch.device("cuda", accelerator.current_device())
    return torch.device("cpu")


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    context_parallel_size: int = 1,
    *,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: Optional[Sequence[int]] = None,
    num_distributed_optimizer_instances: int = 1,
    timeout: Optional[datetime.timedelta] = None,
    kernel_backend: Any = "auto",
) -> ParallelState:
    """Builds the process groups of a tp x cp x dp x pp layout (see the module docstring for the order).

    Call after ``torch.distributed.init_process_group`` (gloo or nccl); every rank must call it, since
    group creation is collective. Without an initialized process group, only the single-process layout
    (all sizes 1) is allowed and its groups are None.

    ``timeout`` bounds every collective and point-to-point transfer on the new groups (pass the job's
    ``--distributed-timeout-minutes``); None keeps torch's default for the backend.

    ``expert_model_parallel_size`` (ep) adds the expert groups (module docstring); it must divide tp * cp * dp.
    ``expert_tensor_parallel_size`` (etp) splits each expert over the etp group (``state.etp_group``, the tp
    group itself when etp = tp); ep x etp must divide tp * cp * dp.

    ``hierarchical_context_parallel_sizes`` (levels of each cp group, innermost first, product cp) adds the
    hierarchical cp groups that ``cp_comm_type`` "a2a+p2p" runs over (module docstring).

    ``num_distributed_optimizer_instances`` (N > 1, dividing dp * cp and expert-dp) adds the partial distributed
    optimizer's intra- and inter-instance groups (module docstring).

    ``kernel_backend`` (``"auto"``, ``"torch"``, ``"triton"`` or a ``kernels.KernelBackend``) is the fused-op
    choice of the modules built with this state (``state.kernel_backend``).

    Raises:
        ValueError: a size < 1, a world size not divisible by tp * pp * cp, an ep x etp that does not divide
            tp * cp * dp, vpp > 1 without pp > 1, or num_distributed_optimizer_instances not dividing dp * cp
            and expert-dp.
    """
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    vpp, ep, etp = virtual_pipeline_model_parallel_size, expert_model_parallel_size, expert_tensor_parallel_size
    hcp_sizes = check_hierarchical_sizes(hierarchical_context_parallel_sizes, cp)
    if not dist.is_initialized():
        validate_sizes(1, tp, pp, cp, vpp, ep, etp)
        distributed_optimizer_groups({"dp_cp": [(0,)]}, num_distributed_optimizer_instances)
        return _single_process_state(vpp, kernel_backend)
    world_size, rank, backend = dist.get_world_size(), dist.get_rank(), dist.get_backend()
    validate_sizes(world_size, tp, pp, cp, vpp, ep, etp)
    fields: dict = {}
    # Middle pipeline stages hold no embedding: their group is None, their ranks those of their pipeline's ends.
    fields["embedding_group"] = None
    fields["etp_size"] = etp
    all_groups = layout_groups(world_size, tp, pp, cp, ep, etp)
    fields["num_distributed_optimizer_instances"] = num_distributed_optimizer_instances
    if num_distributed_optimizer_instances != 1:  # (validates N also when it is not an int)
        all_groups.update(distributed_optimizer_groups(all_groups, num_distributed_optimizer_instances))
    for kind, all_ranks in all_groups.items():
        for ranks in all_ranks:  # Same creation order on every rank: new_group is collective.
            if kind in _EXPERT_KINDS and len(ranks) == 1:  # no group for a lone rank (None = no parallelism)
                group = None
            elif kind == "intra_expert_dp" and ranks in all_groups["intra_dp_cp"]:  # the same ranks: same group
                group = fields["intra_dp_cp_group"] if rank in ranks else None
            elif kind == "etp" and all_groups["etp"] == all_groups["tp"]:  # etp = tp: the tp group itself
                group = fields["tp_group"] if rank in ranks else None
            else:
                group = dist.new_group(list(ranks), timeout=timeout)
            if rank in ranks:
                fields[f"{kind}_group"], fields[f"{kind}_ranks"] = group, ranks
    if hcp_sizes is not None:
        fields.update(_hierarchical_fields(rank, all_groups["cp"], hcp_sizes, timeout))
    pipeline = fields["pp_ranks"]
    fields["embedding_ranks"] = tuple(sorted({pipeline[0], pipeline[-1]}))
    for kind in ("tp", "cp", "dp", "pp", "etp", "ep", "expert_dp"):
        fields[f"{kind}_rank"] = fields[f"{kind}_ranks"].index(rank)
        fields[f"{kind}_size"] = len(fields[f"{kind}_ranks"])
    return ParallelState(
        world_size=world_size, rank=rank, backend=backend, device=_device_for_backend(backend),
        vpp_size=vpp, kernel_backend=kernel_backend, **fields,
    )


def _hierarchical_fields(rank: int, cp_groups: Sequence[tuple[int, ...]], sizes: tuple[int, ...],
                         timeout: Optional[datetime.timedelta]) -> dict:
    """The ``hierarchical_cp_*`` fields of ``rank`` (creates every level's groups: collective)."""
    groups, ranks = [], []
    for level_groups in hierarchical_groups(cp_groups, sizes):
        for members in level_groups:  # same order on every rank
            group = dist.new_group(list(members), timeout=timeout) if len(members) > 1 else None
            if rank in members:
                groups.append(group)
                ranks.append(members)
    return {"hierarchical_cp_sizes": sizes, "hierarchical_cp_groups": tuple(groups),
            "hierarchical_cp_ranks": tuple(ranks)}


def _single_process_state(vpp: Optional[int], kernel_backend: Any = "auto") -> ParallelState:
    axis_fields = {}
    for kind in ("tp", "cp", "dp", "pp"):
        axis_fields.update({f"{kind}_size": 1, f"{kind}_rank": 0, f"{kind}_group": None, f"{kind}_ranks": (0,)})
    return ParallelState(
        world_size=1, rank=0, backend=None, device=torch.device("cpu"), vpp_size=vpp,
        dp_cp_group=None, dp_cp_ranks=(0,), mp_group=None, mp_ranks=(0,),
        embedding_group=None, embedding_ranks=(0,), kernel_backend=kernel_backend, **axis_fields,
    )


def destroy_model_parallel(state: ParallelState) -> None:
    """Destroys the process groups of ``state`` (not the default group). Every rank must call it."""
    if not dist.is_initialized():
        return
    seen = set()
    for field in dataclasses.fields(state):
        value = getattr(state, field.name)
        groups = [value] if field.name.endswith("_group") else list(value) if field.name.endswith("_groups") else []
        for group in groups:
            if group is not None and id(group) not in seen:
                seen.add(id(group))
                dist.destroy_process_group(group)
