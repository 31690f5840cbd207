"""``MegatronOptimizer``: fp32 master weights, loss scaling, global-norm clipping, the distributed optimizer
(ZeRO 1-3: master weights and states for this rank's 1/dp shard only) and CPU offload, in one class.

The optimizer works on *pieces*: for a stage-0 or plain module, every parameter whole; for a stage 1-3
``DistributedDataParallel`` chunk, the part of each parameter inside this rank's shard of each bucket. Each
piece has an fp32 master tensor: the model storage itself when that is already fp32 (and not offloaded),
else an fp32 copy (on the host with offload), or, with ``optimizer_nvme_offload_dir``, none in memory: the
masters and Adam states then live in files (``offload.NvmeAdam``). ``torch.optim.AdamW`` / ``SGD`` (or
``NvmeAdam``) updates the masters; the updated values are copied back into the model storage and, at stages
1-2, all-gathered over dp.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from megatron_core.distributed import DistributedDataParallel
from megatron_core.optimizer.clip_grads import clip_by_norm_, counts_once, found_inf_or_nan, global_norm_and_zeros
from megatron_core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron_core.optimizer.muon import Muon, MuonSettings, matrix_of, muon_parameters
from megatron_core.optimizer.offload.nvme_adam import NvmeAdam
from megatron_core.optimizer.optimizer_config import OptimizerConfig
from megatron_core.parallel_state import ParallelState

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Piece:
    param: nn.Parameter
    model: torch.Tensor                              # 1-D view of the model storage this piece updates
    grad: Callable[[], Optional[torch.Tensor]]       # 1-D grad of the same elements (dp-reduced)
    master: Optional[torch.Tensor]                   # fp32 1-D; ``model`` itself when aliased; None: in files
    aliased: bool
    is_shard: bool                                   # a 1/dp shard (summed over dp in the norm)
    decay: bool
    param_range: tuple[int, int]                     # the flat elements [lo, hi) of the parameter it covers
    param_shape: tuple[int, ...]                     # the parameter's (tp-local) shape, even when freed (ZeRO-3)
    is_expert: bool = False                          # an MoE expert's: sharded over expert-dp, normed apart
    bucket: Optional[object] = None                  # the DDP bucket the piece's storage lies in (None: plain)
    master_grad: Optional[torch.Tensor] = None       # the fp32 grad on the master's device, during step()


def _chunk_pieces(chunk: nn.Module) -> list[tuple]:
    """``(param, model_view, grad_fn, is_shard, (param_lo, param_hi), param_shape, bucket)`` of a model chunk."""
    pieces = []
    if isinstance(chunk, DistributedDataParallel):
        for bucket in chunk.buckets:
            shapes = bucket.shapes
            if chunk.config.zero_stage == 0:
                for param, (lo, hi) in bucket.ranges.items():
                    grad = bucket.grad_data[lo:hi]
                    pieces.append((param, bucket.param_data[lo:hi], lambda g=grad: g, False, (0, hi - lo),
                                   tuple(shapes[param]), bucket))
            else:
                for param, p_lo, p_hi, s_lo, s_hi in bucket.shard_pieces():
                    grad = bucket.grad_shard[s_lo:s_hi]
                    pieces.append((param, bucket.param_shard[s_lo:s_hi], lambda g=grad: g, True, (p_lo, p_hi),
                                   tuple(shapes[param]), bucket))
        return pieces
    for param in dict.fromkeys(p for p in chunk.parameters() if p.requires_grad):
        grad_fn = lambda p=param: None if p.grad is None else p.grad.view(-1)  # noqa: E731
        pieces.append((param, param.data.view(-1), grad_fn, False, (0, param.numel()), tuple(param.shape), None))
    return pieces


def _fused_adam_covers(pieces: Sequence[_Piece]) -> bool:
    """Whether torch's fused AdamW kernel takes every master (floating point, on one device type it covers)."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices
    devices = {p.master.device.type for p in pieces if p.master is not None}
    return len(devices) == 1 and devices <= set(_get_fused_kernels_supported_devices())


class MegatronOptimizer:
    """See the module docstring. Build it with ``get_optimizer``.

    Args:
        config: the optimizer settings.
        chunks: the model chunks (plain modules or ``DistributedDataParallel``).
        parallel_state: the layout (for the norm over tp and pp); None means no model parallelism.
        no_weight_decay_cond: ``cond(param)`` True exempts ``param`` from weight decay; None: parameters with
            fewer than 2 dims are exempt (Megatron's default).
    """

    def __init__(self, config: OptimizerConfig, chunks: Sequence[nn.Module], *,
                 parallel_state: Optional[ParallelState],
                 no_weight_decay_cond: Optional[Callable[[nn.Parameter], bool]] = None) -> None:
        self.config, self.chunks, self.parallel_state = config, list(chunks), parallel_state
        self._no_weight_decay = no_weight_decay_cond
        self.ddp_chunks = [c for c in self.chunks if isinstance(c, DistributedDataParallel)]
        sharded = [c for c in self.ddp_chunks if c.config.zero_stage >= 1]
        self.dp_group = sharded[0].dp_group if sharded else None
        self.expert_dp_group = sharded[0].expert_dp_group if sharded else None
        self.mp_group = parallel_state.mp_group if parallel_state is not None else None
        self.expert_mp_group = parallel_state.expert_mp_group if parallel_state is not None else None
        self.device = parallel_state.device if parallel_state is not None else torch.device("cpu")
        self.nvme = config.optimizer_nvme_offload_dir is not None
        host = torch.device("cpu") if config.optimizer_cpu_offload or self.nvme else None
        with self._shards_resident():  # offloaded ZeRO-3 shards: the pieces are views of them, masters copies
            self.pieces = self._build_pieces(host)
            self.has_experts = self._any_rank_has_experts()
            self.optimizer = self._build_inner() if self.pieces else None
        self.grad_scaler: Optional[ConstantGradScaler] = None
        if config.loss_scale is not None:
            self.grad_scaler = ConstantGradScaler(config.loss_scale)
        elif config.fp16:
            self.grad_scaler = DynamicGradScaler(
                initial_scale=config.initial_loss_scale, min_scale=config.min_loss_scale,
                growth_interval=config.loss_scale_window, hysteresis=config.hysteresis)

    def params_norm(self) -> float:
        """Global L2 norm of the fp32 masters (with NVMe offload, of the model values: the masters cast to the
        model dtype, equal for fp32). Collectives: as ``global_norm``."""
        with self._shards_resident():
            return self.global_norm(lambda p: p.master if p.master is not None else p.model.float())[0]

    def _build_pieces(self, host: Optional[torch.device]) -> list[_Piece]:
        pieces = []
        for chunk in self.chunks:
            for param, model, grad_fn, is_shard, param_range, shape, bucket in _chunk_pieces(chunk):
                aliased = model.dtype == torch.float32 and host is None
                master = model if aliased else None if self.nvme else \
                    model.detach().to(host or model.device, torch.float32).clone()
                exempt = self._no_weight_decay(param) if self._no_weight_decay else len(shape) < 2
                pieces.append(_Piece(param, model, grad_fn, master, aliased, is_shard, decay=not exempt,
                                     param_range=param_range, param_shape=shape,
                                     is_expert=bool(getattr(param, "is_expert", False)), bucket=bucket))
        return pieces

    def _any_rank_has_experts(self) -> bool:
        """Whether any rank holds expert parameters (then every rank runs the expert norm reductions).
        Collective: an all-reduce (max) over all ranks when torch.distributed is initialized."""
        flag = torch.tensor([float(any(p.is_expert for p in self.pieces))], device=self.device)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def global_norm(self, tensor_of: Callable[["_Piece"], Optional[torch.Tensor]], *,
                    count_zeros: bool = False) -> tuple[float, Optional[int]]:
        """L2 norm (and zeros) over all ranks of ``tensor_of(piece)`` (grads or masters), each element once.
        Collectives: see ``clip_grads.global_norm_and_zeros``."""
        counted = [(tensor_of(p), p.is_shard, p.is_expert) for p in self.pieces
                   if tensor_of(p) is not None and counts_once(p.param, self.parallel_state)]
        experts = [(t, s) for t, s, e in counted if e] if self.has_experts else None
        return global_norm_and_zeros([(t, s) for t, s, e in counted if not e], dp_group=self.dp_group,
                                     mp_group=self.mp_group, device=self.device, count_zeros=count_zeros,
                                     expert_grads=experts, expert_dp_group=self.expert_dp_group,
                                     expert_mp_group=self.expert_mp_group)

    def _build_inner(self) -> Union[torch.optim.Optimizer, NvmeAdam]:
        config = self.config
        if self.nvme:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            return NvmeAdam(self.pieces, directory=config.optimizer_nvme_offload_dir, rank=rank,
                            chunk_elements=config.optimizer_nvme_chunk_elements, lr=config.lr,
                            betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                            weight_decay=config.weight_decay, pin_memory=self.device.type == "cuda",
                            fused=config.optimizer_host_adam == "fused")
        if config.optimizer == "muon":
            return self._build_muon()
        groups = [{"params": [p.master for p in self.pieces if p.decay], "weight_decay": config.weight_decay},
                  {"params": [p.master for p in self.pieces if not p.decay], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        if config.optimizer == "adam":
            if config.optimizer_cpu_offload:
                fused = config.optimizer_host_adam == "fused"
            else:
                fused = config.fused_adam and _fused_adam_covers(self.pieces)
            return torch.optim.AdamW(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                                     eps=config.adam_eps, fused=fused or None)
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum)

    def _build_muon(self) -> Muon:
        """Muon over the weight matrices, AdamW (the run's Adam settings) over the rest: ``optimizer.muon``."""
        config = self.config
        tp_group = self.parallel_state.tp_group if self.parallel_state is not None else None
        eligible = muon_parameters(self.chunks, split_qkv=config.muon_split_qkv)
        matrices = {p.master: matrix_of(p, eligible[id(p.param)], tp_mode=config.muon_tp_mode, tp_group=tp_group)
                    for p in self.pieces if id(p.param) in eligible and len(p.param_shape) == 2}
        groups = [{"params": [p.master for p in self.pieces if p.decay == decay and (p.master in matrices) == muon],
                   "weight_decay": config.weight_decay if decay else 0.0, "muon": muon}
                  for muon in (True, False) for decay in (True, False)]
        buckets = [b for chunk in self.ddp_chunks for b in chunk.buckets if chunk.config.zero_stage >= 1
                   and any(id(p) in eligible and len(b.shapes[p]) == 2 for p in b.params)]
        settings = MuonSettings(
            momentum=config.muon_momentum, nesterov=config.muon_use_nesterov, num_ns_steps=config.muon_num_ns_steps,
            coefficient_type=config.muon_coefficient_type, scale_mode=config.muon_scale_mode,
            extra_scale_factor=config.muon_extra_scale_factor, bf16=config.muon_fp32_matmul_prec != "high",
            tp_mode=config.muon_tp_mode)
        fused = config.fused_adam and _fused_adam_covers(self.pieces)
        return Muon([g for g in groups if g["params"]], matrices=matrices, buckets=buckets, settings=settings,
                    lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                    fused=fused or None)

    # ----------------------------------------------------------------------------------------------------------
    # loss scaling
    def get_loss_scale(self) -> torch.Tensor:
        """The current loss scale (1.0 without a scaler)."""
        return torch.tensor(self.grad_scaler.scale if self.grad_scaler else 1.0, dtype=torch.float32)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale``: pass as the schedules' ``grad_scale_func`` or call before ``backward``."""
        return loss * self.grad_scaler.scale if self.grad_scaler else loss

    # ----------------------------------------------------------------------------------------------------------
    # the step
    def _prepare_master_grads(self) -> list[torch.Tensor]:
        grads = []
        for piece in self.pieces:
            grad = piece.grad()
            device = piece.master.device if piece.master is not None else torch.device("cpu")
            if grad is not None and (grad.dtype != torch.float32 or grad.device != device):
                grad = grad.to(device, torch.float32)
            piece.master_grad = grad
            if piece.master is not None:
                piece.master.grad = grad
            if grad is not None:
                grads.append(grad)
        return grads

    def _clear_master_grads(self) -> None:
        for piece in self.pieces:
            piece.master_grad = None
            if piece.master is not None:
                piece.master.grad = None

    @torch.no_grad()
    def step(self) -> tuple[bool, Optional[float], Optional[int]]:
        """Unscales and checks the grads (with a loss scaler), clips by the global norm, updates, and writes
        the new parameters back (all-gathered over dp at stages 1-2).

        Returns:
            ``(update_successful, grad_norm, num_zeros_in_grad)``: ``(False, None, None)`` when an inf/nan
            grad made the step skip; ``num_zeros_in_grad`` is None unless ``log_num_zeros_in_grad``.
        Collectives: all-reduce over dp (sharded stages) and tp x pp of the norm (and the inf flag);
        all-gather over dp of the updated parameters (stages 1-2).
        """
        for chunk in self.ddp_chunks:
            chunk.finish_grad_sync()  # a no-op after finalize_model_grads
            chunk.finish_param_sync()  # the previous step's gather (overlap_param_gather) must not land late
        grads = self._prepare_master_grads()
        if self.grad_scaler is not None:
            torch._foreach_mul_(grads, 1.0 / self.grad_scaler.scale)
            found_inf = found_inf_or_nan(grads, dp_group=self.dp_group, mp_group=self.mp_group, device=self.device,
                                         expert_mp_group=self.expert_mp_group if self.has_experts else None)
            self.grad_scaler.update(found_inf)
            if found_inf:
                self._clear_master_grads()
                logger.info("inf/nan in the grads: step skipped, loss scale now %g", self.grad_scaler.scale)
                return False, None, None
        grad_norm, num_zeros = self.global_norm(lambda p: p.master_grad,
                                                count_zeros=self.config.log_num_zeros_in_grad)
        if self.config.clip_grad > 0:
            clip_by_norm_(grads, max_norm=self.config.clip_grad, total_norm=grad_norm)
        with self._shards_resident():  # ZeRO-3 parameter offload: the shards come back for the update
            if self.optimizer is not None:
                self.optimizer.step()
            self._clear_master_grads()
            self._copy_masters_to_model()
        return True, grad_norm, num_zeros

    @contextlib.contextmanager
    def _shards_resident(self) -> Iterator[None]:
        """Offloaded ZeRO-3 parameter shards in device memory inside the block, written home after it."""
        for chunk in self.ddp_chunks:
            chunk.fetch_param_shards()
        try:
            yield
        finally:
            for chunk in self.ddp_chunks:
                chunk.evict_param_shards()

    def _copy_masters_to_model(self) -> None:
        for piece in self.pieces:
            if piece.master is not None and not piece.aliased:  # NvmeAdam wrote the model chunk by chunk
                piece.model.copy_(piece.master)
        for chunk in self.ddp_chunks:
            chunk.start_param_sync()
        for chunk in self.ddp_chunks:
            if not chunk.config.overlap_param_gather:  # else each module waits just before its next forward
                chunk.finish_param_sync()

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Copies the model's parameters into the fp32 master weights (after loading new weights into the
        model without the optimizer state, as Megatron's ``reload_model_params``)."""
        with self._shards_resident():
            for piece in self.pieces:
                if not piece.aliased:
                    self.set_piece_state(piece, "master", piece.model)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeros the model grads (each DDP chunk's buffers; ``.grad`` of plain modules)."""
        for chunk in self.chunks:
            if isinstance(chunk, DistributedDataParallel):
                chunk.zero_grad_buffer()
            else:
                chunk.zero_grad(set_to_none=set_to_none)
        self._clear_master_grads()

    # ----------------------------------------------------------------------------------------------------------
    # state
    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups (e.g. to set ``lr`` from a scheduler)."""
        return self.optimizer.param_groups if self.optimizer is not None else []

    def state_dict(self) -> dict:
        """This rank's state: the inner optimizer's, the fp32 master pieces (when not the model storage) and
        the loss scaler's, as tensors."""
        scaler = {k: torch.tensor(v) for k, v in self.grad_scaler.state_dict().items()} if self.grad_scaler else {}
        return {"optimizer": self.optimizer.state_dict() if self.optimizer is not None else {},
                "master_weights": [self.piece_states(p)["master"] for p in self.pieces if not p.aliased],
                "grad_scaler": scaler}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict()`` of an optimizer built over the same model, layout and config."""
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        masters = [p for p in self.pieces if not p.aliased]
        if len(masters) != len(state["master_weights"]):
            raise ValueError(f"the state has {len(state['master_weights'])} master pieces, this optimizer "
                             f"{len(masters)}: load it into an optimizer of the same model, layout and config")
        for piece, saved in zip(masters, state["master_weights"]):
            self.set_piece_state(piece, "master", saved)
        if self.grad_scaler is not None and state["grad_scaler"]:
            self.grad_scaler.load_state_dict({k: v.item() for k, v in state["grad_scaler"].items()})
        with self._shards_resident():
            self._copy_masters_to_model()

    def master_weight_bytes(self) -> int:
        """Bytes of fp32 master copies in memory (none with NVMe offload: see ``nvme_bytes``)."""
        return sum(p.master.numel() * p.master.element_size() for p in self.pieces
                   if not p.aliased and p.master is not None)

    def nvme_bytes(self) -> dict[str, int]:
        """Bytes of master weights and optimizer states held in NVMe files (empty without NVMe offload)."""
        return self.optimizer.state_bytes() if isinstance(self.optimizer, NvmeAdam) else {}

    def optimizer_state_bytes(self) -> int:
        """Bytes of the inner optimizer's per-element states (``step`` counters excluded)."""
        if self.optimizer is None or isinstance(self.optimizer, NvmeAdam):
            return 0
        return sum(v.numel() * v.element_size() for s in self.optimizer.state.values() for k, v in s.items()
                   if isinstance(v, torch.Tensor) and k != "step")

    # ----------------------------------------------------------------------------------------------------------
    # per-piece states (the layout-independent checkpoints read and write these)
    def piece_states(self, piece: _Piece) -> dict[str, torch.Tensor]:
        """``{"master" (unless aliased), "exp_avg", "exp_avg_sq" / "momentum_buffer": fp32 1-D tensor}`` of
        ``piece`` (new tensors with NVMe offload, read from the files; else the live ones)."""
        if isinstance(self.optimizer, NvmeAdam):
            index = next(i for i, p in enumerate(self.pieces) if p is piece)
            names = ("master",) + (("exp_avg", "exp_avg_sq") if self.optimizer.steps[index] else ())
            return {name: self.optimizer.read_piece_state(index, name) for name in names}
        states = {} if piece.aliased else {"master": piece.master}
        inner = self.optimizer.state.get(piece.master, {}) if self.optimizer is not None else {}
        states.update({k: v for k, v in inner.items() if k != "step" and isinstance(v, torch.Tensor)})
        return states

    @torch.no_grad()
    def set_piece_state(self, piece: _Piece, name: str, values: torch.Tensor, *, step: float = 0.0) -> None:
        """Stores ``values`` as state ``name`` of ``piece``; an inner state (not ``master``) sets its step."""
        if isinstance(self.optimizer, NvmeAdam):
            index = next(i for i, p in enumerate(self.pieces) if p is piece)
            self.optimizer.write_piece_state(index, name, values)
            if name != "master":
                self.optimizer.steps[index] = int(step)
        elif name == "master":
            piece.master.copy_(values)
        elif self.optimizer is not None:
            inner = self.optimizer.state[piece.master]
            inner[name] = values.detach().reshape(-1).to(piece.master.device, torch.float32).clone()
            fused = bool(self.optimizer.defaults.get("fused"))  # the fused kernel reads step on the master's device
            inner["step"] = torch.tensor(float(step), dtype=torch.float32,
                                         device=piece.master.device if fused else None)

    def step_count(self) -> float:
        """The largest per-piece step count of the inner optimizer (0 before the first step)."""
        if isinstance(self.optimizer, NvmeAdam):
            return float(max(self.optimizer.steps, default=0))
        steps = [float(s["step"]) for s in (self.optimizer.state.values() if self.optimizer else []) if "step" in s]
        return max(steps, default=0.0)
