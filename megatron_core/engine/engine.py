"""``Engine``: DeepSpeed's training-engine API over megatron_core's ``DistributedDataParallel`` (ZeRO 0-3)
and ``MegatronOptimizer`` (fp32 masters, loss scaling, clipping, offload). Build it with
``megatron_core.engine.initialize``.

One training step is ``gradient_accumulation_steps`` micro-steps of

    loss = engine(batch)          # the wrapped module's forward (ZeRO-3: each unit all-gathered, then freed)
    engine.backward(loss)         # loss / accumulation * loss scale, backward; grads reduced over dp
    engine.step()                 # at the accumulation boundary: unscale, inf check, clip, update, lr step

Collectives per micro-step, over the dp group: stage 0 all-reduces the grad buckets (on the boundary
micro-step only: the others run under ``no_sync()``), stage 1 reduce-scatters them (boundary only),
stages 2-3 reduce-scatter them after every backward; stage 3 also all-gathers each unit's parameters in
forward and again in backward. At the boundary ``step()`` all-reduces the grad norm (and the inf flag with
fp16) and, at stages 1-2, all-gathers the updated parameters.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Iterator, Optional

import torch
from torch import nn

from megatron_core.distributed import DistributedDataParallel, finalize_model_grads
from megatron_core.engine.config import EngineConfig
from megatron_core.optimizer import DynamicGradScaler, MegatronOptimizer
from megatron_core.parallel_state import ParallelState

logger = logging.getLogger(__name__)


def _cast_half(value: Any) -> Any:
    """Floating-point tensors in ``value`` (nested lists, tuples, dicts) as fp16 (``fp16.auto_cast``)."""
    if isinstance(value, torch.Tensor):
        return value.half() if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_half(v) for v in value)
    if isinstance(value, dict):
        return {k: _cast_half(v) for k, v in value.items()}
    return value


class SmallParametersRoot(nn.Module):
    """ZeRO-3's root unit around the user's model: it claims every 1-D parameter (biases, norm weights), which
    are then gathered once for the whole forward and once for the whole backward instead of one small
    all-gather per module (``gathers_small_parameters`` of ``distributed.zero3.plan_units``). The engine uses
    it when ``stage3_param_persistence_threshold`` > 0 (DeepSpeed keeps parameters under the threshold
    unpartitioned; here they stay sharded between steps)."""

    gathers_small_parameters = True

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)


class Engine(nn.Module):
    """The engine ``initialize`` returns (DeepSpeed's ``DeepSpeedEngine``).

    Args:
        ddp: the model wrapped for data parallelism (its ``module`` is the user's model).
        optimizer: the optimizer over ``ddp`` (None: forward only; ``backward``/``step`` raise).
        lr_scheduler: DeepSpeed's schedule, the client's, or None.
        config: the resolved DeepSpeed config.
        state: the parallel layout (dp = world size).
        lr_follower: a client optimizer whose ``lr`` a client scheduler drives: copied to ``optimizer``
            after every scheduler step.
        num_param_groups: the client's param groups (``get_lr()`` returns one lr per group).
    """

    def __init__(self, *, ddp: DistributedDataParallel, optimizer: Optional[MegatronOptimizer],
                 lr_scheduler: Any, config: EngineConfig, state: ParallelState,
                 lr_follower: Optional[torch.optim.Optimizer] = None, num_param_groups: int = 1) -> None:
        super().__init__()
        self.ddp = ddp
        self.optimizer, self.lr_scheduler, self.config, self.state = optimizer, lr_scheduler, config, state
        self._lr_follower, self._num_param_groups = lr_follower, num_param_groups
        self.micro_steps = self.global_steps = self.global_samples = self.skipped_steps = 0
        self._global_grad_norm: Optional[float] = None
        self._boundary_override: Optional[bool] = None
        self._step_applied = False
        self._times = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self.training_dataloader = None
        self._follow_lr()

    # ----------------------------------------------------------------------------------------------------------
    # attributes DeepSpeed users read
    @property
    def module(self) -> nn.Module:
        """The user's model (at ZeRO-3 its parameters are empty outside forward: see ``zero.GatheredParameters``)."""
        wrapped = self.ddp.module
        return wrapped.model if isinstance(wrapped, SmallParametersRoot) else wrapped

    @property
    def dp_world_size(self) -> int:
        return self.state.dp_size

    @property
    def global_rank(self) -> int:
        return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    @property
    def device(self) -> torch.device:
        return self.ddp.device

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without fp16)."""
        return float(self.optimizer.get_loss_scale()) if self.optimizer is not None else 1.0

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(Engine.module.fget(self), name)

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def zero_optimization_stage(self) -> int:
        return self.config.zero_stage

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def fp16_enabled(self) -> bool:
        return self.config.fp16_enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16_enabled

    def get_lr(self) -> list[float]:
        """The lr of each of the client's param groups (one value: the engine sets one lr for all)."""
        if self.optimizer is None or not self.optimizer.param_groups:
            return []
        return [self.optimizer.param_groups[0]["lr"]] * self._num_param_groups

    def get_mom(self) -> list:
        """Adam's betas (or SGD's momentum) of each of the client's param groups."""
        if self.optimizer is None or not self.optimizer.param_groups:
            return []
        group = self.optimizer.param_groups[0]
        return [group.get("betas", group.get("momentum"))] * self._num_param_groups

    def get_global_grad_norm(self) -> Optional[float]:
        """The global L2 norm of the (unscaled, unclipped) grads of the last optimizer step; None before the
        first step and after a skipped one."""
        return self._global_grad_norm

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` updated the parameters (False at a non-boundary micro-step or a skip)."""
        return self._step_applied

    # ----------------------------------------------------------------------------------------------------------
    # forward, backward, step
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        if self.config.fp16["auto_cast"]:
            args, kwargs = _cast_half(args), _cast_half(kwargs)
        output = self.ddp(*args, **kwargs)
        self._times["forward"] += time.perf_counter() - start
        return output

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step ends the accumulation (its backward reduces, its ``step()`` updates)."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Overrides the boundary (DeepSpeed's manual mode); None returns to counting micro-steps."""
        self._boundary_override = is_boundary

    def _require_optimizer(self, what: str) -> MegatronOptimizer:
        if self.optimizer is None:
            raise ValueError(f"engine.{what}() needs an optimizer: set the config's optimizer section or pass "
                             "optimizer= to initialize()")
        return self.optimizer

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss / gradient_accumulation_steps`` (with ``scale_wrt_gas``) times the loss scale.

        Returns the accumulation-scaled loss (unscaled by the loss scale), as DeepSpeed does.
        Collectives: the grad buckets' reductions over dp, started from backward hooks (stages 0-1: on the
        boundary micro-step only; stages 2-3: every micro-step); stage 3 all-gathers units for backward.
        """
        optimizer = self._require_optimizer("backward")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"engine.backward(loss) needs a scalar loss tensor, got {type(loss).__name__}"
                             f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        start = time.perf_counter()
        if scale_wrt_gas:
            loss = loss / self.gradient_accumulation_steps()
        sync = contextlib.nullcontext() if self.is_gradient_accumulation_boundary() else self.ddp.no_sync()
        with sync:
            optimizer.scale_loss(loss).backward(retain_graph=retain_graph)
        self._times["backward"] += time.perf_counter() - start
        return loss

    def step(self, lr_kwargs: Optional[dict] = None) -> None:
        """At the accumulation boundary: the optimizer step (unscale, inf check, clip to
        ``gradient_clipping``, update), the lr schedule (not after a skipped fp16 step), zeroed grads."""
        optimizer = self._require_optimizer("step")
        start = time.perf_counter()
        self._step_applied = False
        if self.is_gradient_accumulation_boundary():
            self._take_model_step(optimizer, lr_kwargs or {})
        self.micro_steps += 1
        self._times["step"] += time.perf_counter() - start

    def _take_model_step(self, optimizer: MegatronOptimizer, lr_kwargs: dict) -> None:
        finalize_model_grads([self.ddp], self.state)
        scaler = optimizer.grad_scaler
        at_floor = isinstance(scaler, DynamicGradScaler) and scaler.scale <= scaler.min_scale \
            and scaler.hysteresis_tracker <= 1
        applied, grad_norm, _ = optimizer.step()
        optimizer.zero_grad()
        self._step_applied = applied
        if applied:
            self._global_grad_norm = grad_norm
            if isinstance(scaler, DynamicGradScaler) and self.config.fp16["consecutive_hysteresis"]:
                scaler.hysteresis_tracker = scaler.hysteresis
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**lr_kwargs)
                self._follow_lr()
        else:
            self._global_grad_norm = None
            self.skipped_steps += 1
            if at_floor:
                raise RuntimeError(f"fp16 gradients overflowed at the minimum loss scale {scaler.min_scale} "
                                   "(fp16.min_loss_scale): the run cannot continue (DeepSpeed stops here too); "
                                   "lower the lr, use bf16, or check the data")
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self._maybe_report()

    def _follow_lr(self) -> None:
        """A client scheduler drives a client optimizer's lr: copy it (and its betas) into ours."""
        if self._lr_follower is None or self.optimizer is None:
            return
        source = self._lr_follower.param_groups
        lrs = {float(group["lr"]) for group in source}
        if len(lrs) != 1:
            raise ValueError(f"the client lr_scheduler set different lrs per param group ({sorted(lrs)}); the "
                             "engine keeps one lr for all groups")
        lr = lrs.pop()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            if "betas" in source[0] and "betas" in group:
                group["betas"] = tuple(source[0]["betas"])

    def _maybe_report(self) -> None:
        every = self.config.steps_per_print
        if every is None or self.global_rank != 0 or self.global_steps % every:
            return
        logger.info("step=%d, skipped=%d, lr=%s, mom=%s, loss_scale=%g, grad_norm=%s", self.global_steps,
                    self.skipped_steps, self.get_lr(), self.get_mom(), self.loss_scale, self._global_grad_norm)
        if self.config.wall_clock_breakdown:
            logger.info("time (ms) | forward: %.2f | backward: %.2f | step: %.2f (totals since the last report)",
                        *(1e3 * self._times[k] for k in ("forward", "backward", "step")))
            self._times = dict.fromkeys(self._times, 0.0)

    def zero_grad(self) -> None:
        """Zeros the gradient buffers (``step()`` does so after every optimizer step)."""
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        else:
            self.ddp.zero_grad_buffer()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate grads (stages 0-1; DeepSpeed refuses it at stages 2-3)."""
        if self.config.zero_stage >= 2:
            raise ValueError(f"engine.no_sync() is not supported at ZeRO stage {self.config.zero_stage} (grads "
                             "are reduce-scattered every backward); the engine accumulates on its own")
        with self.ddp.no_sync():
            yield

    def train(self, mode: bool = True) -> "Engine":
        self.ddp.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    # ----------------------------------------------------------------------------------------------------------
    # checkpoints (megatron_core.engine.checkpoint)
    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Writes ``save_dir/tag`` (default tag ``global_step<N>``) and, with ``save_latest``, ``save_dir/latest``.
        Collective: every rank calls it. See ``megatron_core.engine.checkpoint.save``."""
        from megatron_core.engine.checkpoint import save
        return save(self, save_dir, tag=tag, client_state=client_state or {}, save_latest=save_latest,
                    exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None
                        ) -> tuple[Optional[str], Optional[dict]]:
        """Loads ``load_dir/tag`` (default: the tag in ``load_dir/latest``), at any dp size and ZeRO stage.
        Returns ``(path, client_state)``, or ``(None, None)`` when there is no ``latest`` file. Collective."""
        from megatron_core.engine.checkpoint import load
        if custom_load_fn is not None:
            raise ValueError("custom_load_fn is not supported: the engine loads its own checkpoint format")
        return load(self, load_dir, tag=tag, strict=load_module_strict,
                    load_optimizer_states=load_optimizer_states and not load_module_only,
                    load_lr_scheduler_states=load_lr_scheduler_states and not load_module_only)


__all__ = ["Engine", "SmallParametersRoot"]
