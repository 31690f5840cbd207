"""Learning-rate schedule of Megatron-LM: linear warmup from ``init_lr``, then constant, linear, cosine or
inverse-square-root decay to ``min_lr`` at ``decay_iters``, ``min_lr`` after.

The scheduler counts steps in one unit: iterations, or with ``counts_samples`` samples (each step advances
by the global batch, as Megatron's sample-based training does). ``warmup_iters`` / ``decay_iters`` are in
that unit. Param groups marked ``decoupled_lr`` (input embedding and output layer, ``--decoupled-lr``)
follow the same shape between ``decoupled_lr`` and ``decoupled_min_lr``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


@dataclasses.dataclass
class LRScheduler:
    """``lr(step)`` and ``step()``; ``apply`` writes the next step's lr into the optimizer's param groups."""

    max_lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int
    decay_style: str = "cosine"
    num_steps: int = 0
    init_lr: float = 0.0
    """lr at the start of the warmup (``--lr-warmup-init``)."""
    decoupled_lr: Optional[float] = None
    decoupled_min_lr: Optional[float] = None
    """Default: ``min_lr``."""
    counts_samples: bool = False
    """Steps are samples (advance by the global batch), else iterations."""

    def __post_init__(self) -> None:
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"decay_style must be one of {DECAY_STYLES}, got {self.decay_style!r}")
        if not 0.0 <= self.min_lr <= self.max_lr:
            raise ValueError(f"need 0 <= min_lr <= lr, got min_lr={self.min_lr}, lr={self.max_lr}")
        if self.warmup_iters < 0 or self.decay_iters < self.warmup_iters:
            raise ValueError(f"need 0 <= warmup_iters <= decay_iters, got warmup_iters={self.warmup_iters}, "
                             f"decay_iters={self.decay_iters}")
        if not 0.0 <= self.init_lr <= self.max_lr:
            raise ValueError(f"need 0 <= init_lr (--lr-warmup-init) <= lr, got {self.init_lr} and {self.max_lr}")

    def lr(self, step: int, *, decoupled: bool = False) -> float:
        """The lr at ``step`` (of the decoupled groups with ``decoupled``)."""
        max_lr, min_lr = self.max_lr, self.min_lr
        if decoupled and self.decoupled_lr is not None:
            max_lr = self.decoupled_lr
            min_lr = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
        if self.warmup_iters > 0 and step <= self.warmup_iters:
            return self.init_lr + (max_lr - self.init_lr) * step / self.warmup_iters
        if self.decay_style == "constant":
            return max_lr
        if self.decay_style == "inverse-square-root":
            return max(min_lr, max_lr * math.sqrt(max(self.warmup_iters, 1)) / math.sqrt(max(step, 1)))
        if step >= self.decay_iters:
            return min_lr
        ratio = (step - self.warmup_iters) / max(self.decay_iters - self.warmup_iters, 1)
        coeff = 1.0 - ratio if self.decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def increment(self, global_batch: int) -> int:
        """How far one optimizer step advances the schedule."""
        return global_batch if self.counts_samples else 1

    def current_lr(self, increment: int = 1) -> float:
        """The lr of the next optimizer step (Megatron counts the step being taken: warmup starts above 0)."""
        return self.lr(self.num_steps + increment)

    def apply(self, param_groups, increment: int = 1) -> float:
        """Writes the next step's lr into each param group (the decoupled schedule for groups marked
        ``decoupled_lr``, else scaled by a group's ``lr_mult``); returns the main lr."""
        lr = self.current_lr(increment)
        for group in param_groups:
            if group.get("decoupled_lr"):
                group["lr"] = self.lr(self.num_steps + increment, decoupled=True)
            else:
                group["lr"] = lr * group.get("lr_mult", 1.0)
        return lr

    def step(self, increment: int = 1) -> None:
        self.num_steps += increment

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])
