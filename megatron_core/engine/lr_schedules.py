"""DeepSpeed's learning-rate schedules (``deepspeed/runtime/lr_schedules.py``, 0.19): the same formulas,
the same step counting, written here.

Each schedule sets ``group["lr"]`` of every param group of the optimizer it is given (anything with
``param_groups``) when built and on every ``step()``. ``last_batch_iteration`` starts at -1; the engine calls
``step()`` after each optimizer step that was applied (not after a skipped fp16 step), so optimizer step k
(1-based) runs with the lr of ``last_batch_iteration = k - 2`` (the first with the lr set at construction).
Values are scalars here (DeepSpeed also takes one per param group; the engine's groups are its own).

With ``n = max(2, warmup_num_steps)`` and ``t = last_batch_iteration``:

* ``WarmupLR``: ``min + (max - min) * gamma``, gamma = ``log(t + 1) / log(n)`` ("log") or ``t / n``
  ("linear") while ``t < n``, else 1; ``min`` before the first step (t = -1).
* ``WarmupDecayLR``: as WarmupLR, then gamma = ``max(0, (total - t) / max(1, total - n))``.
* ``WarmupCosineLR``: the optimizer's lr times a ratio: warmup ``wmin + (1 - wmin) * gamma``, then
  ``max(0, cmin + (1 - cmin) * (1 + cos(pi * min(1, (t - n + 1) / max(1, total - n)))) / 2)``; 0 at t = -1.
* ``OneCycle``: the lr cycles from ``cycle_min_lr`` up to ``cycle_max_lr`` over ``cycle_first_step_size``
  iterations and back over ``cycle_second_step_size`` (optionally in stairs), then decays as
  ``min / (1 + decay_lr_rate * (t - total + 1) / decay_step_size)``; Adam's beta1 cycles inversely between
  ``cycle_max_mom`` and ``cycle_min_mom`` (beta2 becomes 0.99, as DeepSpeed sets it).
* ``LRRangeTest``: ``min_lr * (1 + rate * (t + 1) / step_size)`` (floor of the interval with staircase).
"""
from __future__ import annotations

import logging
import math
from types import MappingProxyType
from typing import Any, Optional

logger = logging.getLogger(__name__)

WARMUP_TYPES = ("log", "linear")


def _scalar(value: Any, name: str) -> float:
    if isinstance(value, (list, tuple)):
        raise ValueError(f"{name}={value!r}: a per-group list is not supported by the engine (its param groups "
                         "are its own); give one number")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _set_lr(optimizer: Any, lr: float) -> list[float]:
    for group in optimizer.param_groups:
        group["lr"] = lr
    return [group["lr"] for group in optimizer.param_groups]


def _warmup_type(warmup_type: str) -> str:
    if warmup_type not in WARMUP_TYPES:  # DeepSpeed warns and falls back to log
        logger.warning("unknown warmup_type %r: using 'log' (as DeepSpeed does)", warmup_type)
        return "log"
    return warmup_type


class _Schedule:
    """The step counting shared by every schedule (DeepSpeed's ``last_batch_iteration``)."""

    last_batch_iteration: int

    def lr_at(self, iteration: int) -> float:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return [self.lr_at(self.last_batch_iteration)] * len(self.optimizer.param_groups)

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None \
            else last_batch_iteration
        self._last_lr = _set_lr(self.optimizer, self.lr_at(self.last_batch_iteration))

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])


class WarmupLR(_Schedule):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` (default: the optimizer's lr) over ``warmup_num_steps``."""

    def __init__(self, optimizer: Any, warmup_min_lr: float = 0.0, warmup_max_lr: Optional[float] = None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        _positive_int(warmup_num_steps, "warmup_num_steps")
        self.optimizer = optimizer
        if warmup_max_lr is None:
            warmup_max_lr = optimizer.param_groups[0]["lr"]
        self.min_lr, self.max_lr = _scalar(warmup_min_lr, "warmup_min_lr"), _scalar(warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _warmup_type(warmup_type)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _set_lr(optimizer, self.lr_at(last_batch_iteration)) if last_batch_iteration == -1 \
            else [g["lr"] for g in optimizer.param_groups]

    def _warmup_gamma(self, t: int) -> float:
        if self.warmup_type == "log":
            return math.log(t + 1) / math.log(self.warmup_num_steps)
        return t / self.warmup_num_steps

    def gamma(self, t: int) -> float:
        return self._warmup_gamma(t) if t < self.warmup_num_steps else 1.0

    def lr_at(self, t: int) -> float:
        if t < 0:
            return self.min_lr
        return self.min_lr + (self.max_lr - self.min_lr) * self.gamma(t)


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to 0 at ``total_num_steps``."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float = 0.001, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.total_num_steps = _positive_int(total_num_steps, "total_num_steps")
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning("total_num_steps %d is less than warmup_num_steps %d", total_num_steps, warmup_num_steps)

    def gamma(self, t: int) -> float:
        if t < self.warmup_num_steps:
            return self._warmup_gamma(t)
        return max(0.0, (self.total_num_steps - t) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    """The optimizer's lr scaled by a warmup ratio, then a cosine decay to ``cos_min_ratio``."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        _positive_int(warmup_num_steps, "warmup_num_steps")
        self.optimizer = optimizer
        self.total_num_steps = _positive_int(total_num_steps, "total_num_steps")
        self.warmup_min_ratio = _scalar(warmup_min_ratio, "warmup_min_ratio")
        self.cos_min_ratio = _scalar(cos_min_ratio, "cos_min_ratio")
        self.warmup_type = _warmup_type(warmup_type)
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.org_lr = float(optimizer.param_groups[0]["lr"])
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _set_lr(optimizer, self.lr_at(last_batch_iteration)) if last_batch_iteration == -1 \
            else [g["lr"] for g in optimizer.param_groups]

    def ratio(self, t: int) -> float:
        if t < 0:
            return 0.0
        n = self.warmup_num_steps
        if t < n:
            gamma = math.log(t + 1) / math.log(n) if self.warmup_type == "log" else t / n
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (t - n + 1) / max(1, self.total_num_steps - n))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lr_at(self, t: int) -> float:
        return self.org_lr * self.ratio(t)

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration, "org_lr": self.org_lr}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.org_lr = float(state.get("org_lr", self.org_lr))


class OneCycle(_Schedule):
    """DeepSpeed's 1Cycle policy (lr and, for optimizers with ``betas``, beta1)."""

    def __init__(self, optimizer: Any, cycle_min_lr: float, cycle_max_lr: float, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: Optional[int] = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: Optional[int] = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
                 cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0, last_batch_iteration: int = -1) -> None:
        self.optimizer = optimizer
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0 or second < 0:
            raise ValueError(f"cycle_first_step_size ({cycle_first_step_size}) must be > 0 and "
                             f"cycle_second_step_size ({cycle_second_step_size}) >= 0")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_first_stair_count if cycle_second_stair_count is None \
            else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.min_lr, self.max_lr = _scalar(cycle_min_lr, "cycle_min_lr"), _scalar(cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = float(decay_lr_rate)
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(self.decay_lr_rate, 0)
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.param_groups[0]
        if cycle_momentum and not self.cycle_momentum:
            logger.warning("cycle_momentum is disabled: the optimizer has no betas (as DeepSpeed does)")
        self.min_mom, self.max_mom = _scalar(cycle_min_mom, "cycle_min_mom"), _scalar(cycle_max_mom, "cycle_max_mom")
        self.decay_mom_rate = float(decay_mom_rate)
        self.skip_mom_decay = math.isclose(decay_step_size, 0) or math.isclose(self.decay_mom_rate, 0)
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = _set_lr(optimizer, self.min_lr)
            if self.cycle_momentum:
                self._set_betas(self.min_mom)
        else:
            self._last_lr = [g["lr"] for g in optimizer.param_groups]

    def _set_betas(self, beta1: float) -> None:
        for group in self.optimizer.param_groups:
            group["betas"] = (beta1, 0.99)

    def scale_factor(self, t: int) -> float:
        """The position in the cycle, 0 (min lr) to 1 (max lr), at iteration ``t``."""
        iteration = t + 1
        cycle = math.floor(1 + iteration / self.total_size)
        x = 1.0 + iteration / self.total_size - cycle
        if x <= self.step_ratio:
            factor, stairs = x / self.step_ratio, self.first_stair_count
        else:
            factor, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            in_cycle = iteration % self.total_size
            position = in_cycle * stairs / self.first_step_size if in_cycle <= self.first_step_size \
                else (self.total_size - in_cycle) * stairs / self.second_step_size
            factor = math.floor(position) / stairs
        return factor

    def lr_at(self, t: int) -> float:
        if t < self.total_size:
            return self.min_lr + (self.max_lr - self.min_lr) * self.scale_factor(t)
        if self.skip_lr_decay:
            return self.min_lr
        return self.min_lr / (1 + self.decay_lr_rate * (t - self.total_size + 1) / self.decay_step_size)

    def mom_at(self, t: int) -> float:
        if t < self.total_size:
            return self.max_mom - (self.max_mom - self.min_mom) * self.scale_factor(t)
        if self.skip_mom_decay:
            return self.max_mom
        return self.max_mom * (1 + self.decay_mom_rate * (t - self.total_size + 1) / self.decay_step_size)

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        super().step(last_batch_iteration)
        if self.cycle_momentum:
            self._set_betas(self.mom_at(self.last_batch_iteration))


class LRRangeTest(_Schedule):
    """Grows the lr from ``lr_range_test_min_lr`` linearly (or in stairs) every ``step_size`` iterations."""

    def __init__(self, optimizer: Any, lr_range_test_min_lr: float = 1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1) -> None:
        self.optimizer = optimizer
        self.min_lr = _scalar(lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = _positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_rate, self.staircase = float(lr_range_test_step_rate), bool(lr_range_test_staircase)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _set_lr(optimizer, self.min_lr) if last_batch_iteration == -1 \
            else [g["lr"] for g in optimizer.param_groups]

    def lr_at(self, t: int) -> float:
        interval = (t + 1) / self.step_size
        return self.min_lr * (1 + self.step_rate * (math.floor(interval) if self.staircase else interval))


SCHEDULES = MappingProxyType({"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
             "OneCycle": OneCycle, "LRRangeTest": LRRangeTest})

__all__ = ["SCHEDULES", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"]
