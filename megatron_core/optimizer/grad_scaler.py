"""Loss scalers for fp16 training (Megatron's ``ConstantGradScaler`` and ``DynamicGradScaler``)."""
from __future__ import annotations


class ConstantGradScaler:
    """A fixed loss scale (``--loss-scale``)."""

    def __init__(self, scale: float) -> None:
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        del found_inf

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler(ConstantGradScaler):
    """Megatron's dynamic scaling: an overflowing step decrements the hysteresis counter and, when it reaches
    0, multiplies the scale by ``backoff_factor`` (not below ``min_scale``); ``growth_interval`` good steps
    in a row multiply it by ``growth_factor`` and reset the hysteresis counter."""

    def __init__(self, *, initial_scale: float, min_scale: float, growth_interval: int, hysteresis: int,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5) -> None:
        super().__init__(initial_scale)
        self.min_scale, self.growth_interval, self.hysteresis = float(min_scale), growth_interval, hysteresis
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_tracker, self.hysteresis_tracker = 0, hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker, self.hysteresis_tracker = 0, self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])
