"""Learning-rate schedule of Megatron-LM: linear warmup from 0, then constant, linear or cosine decay to
``min_lr`` at ``decay_iters``, ``min_lr`` after."""
from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass
class LRScheduler:
    """``lr(iteration)`` and ``step()`` (which also writes the lr into the optimizer's param groups)."""

    max_lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int
    decay_style: str = "cosine"
    num_steps: int = 0

    def __post_init__(self) -> None:
        if self.decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"decay_style must be constant, linear or cosine, got {self.decay_style!r}")
        if not 0.0 <= self.min_lr <= self.max_lr:
            raise ValueError(f"need 0 <= min_lr <= lr, got min_lr={self.min_lr}, lr={self.max_lr}")
        if self.warmup_iters < 0 or self.decay_iters < self.warmup_iters:
            raise ValueError(f"need 0 <= warmup_iters <= decay_iters, got warmup_iters={self.warmup_iters}, "
                             f"decay_iters={self.decay_iters}")

    def lr(self, step: int) -> float:
        if self.warmup_iters > 0 and step <= self.warmup_iters:
            return self.max_lr * step / self.warmup_iters
        if self.decay_style == "constant":
            return self.max_lr
        if step >= self.decay_iters:
            return self.min_lr
        ratio = (step - self.warmup_iters) / max(self.decay_iters - self.warmup_iters, 1)
        coeff = 1.0 - ratio if self.decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def current_lr(self) -> float:
        """The lr of the next optimizer step (Megatron counts the step being taken: warmup starts above 0)."""
        return self.lr(self.num_steps + 1)

    def apply(self, param_groups) -> float:
        """Writes the next step's lr into each param group (scaled by a group's ``lr_mult``); returns it."""
        lr = self.current_lr()
        for group in param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        return lr

    def step(self) -> None:
        self.num_steps += 1

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])
