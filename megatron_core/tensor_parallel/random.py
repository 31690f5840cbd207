"""RNG states for tensor-parallel dropout, and activation checkpointing that replays them on recompute.

Dropout on a *replicated* activation (the residual stream after a row-parallel layer) must draw the same
mask on every tp rank; dropout on a *partitioned* activation (attention probabilities of this rank's heads)
must draw a different mask per tp rank. Megatron keeps two streams: the default generator, seeded the same
on every tp rank, and a named "model-parallel" state seeded per tp rank, entered with
``tracker.fork()``. The tracker here is device-agnostic: it swaps the default generator state of the
device it was built for (CPU, or the current CUDA device on CUDA). There is no process-wide tracker: each
``ParallelState`` holds one (``state.rng_tracker``), and the modules built with that state use it.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils.checkpoint

from megatron_core.utils import accelerator

MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_SEED_OFFSET = 2718  # Megatron's offset between the default seed and the tensor-parallel seed.


def _get_rng_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return accelerator.get_rng_state(device)
    return torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        accelerator.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named RNG states that ``fork(name)`` swaps in for the default generator of ``device``."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()
        self.recompute_depth = 0
        """> 0 while a ``checkpoint`` with this tracker re-runs its function in backward: counters a forward
        updates once per step (MoE loss sums, expert-bias token counts) skip that second pass."""

    @property
    def recomputing(self) -> bool:
        return self.recompute_depth > 0

    def reset(self) -> None:
        self._states.clear()
        self._seeds.clear()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every named state (for checkpoints and activation recompute)."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Creates state ``name`` from ``seed``; names and seeds must be unique (ValueError otherwise)."""
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists")
        if seed in self._seeds:
            raise ValueError(f"seed {seed} is already used by another RNG state; pick a distinct seed")
        self._states[name] = accelerator.seeded_rng_state(self.device, seed)
        self._seeds.add(seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Runs the block with state ``name`` as the default generator, then restores the default state."""
        if name not in self._states:
            raise ValueError(f"RNG state {name!r} was never added; known states: {sorted(self._states)}")
        outer = _get_rng_state(self.device)
        _set_rng_state(self._states[name], self.device)
        try:
            yield
        finally:
            self._states[name] = _get_rng_state(self.device)
            _set_rng_state(outer, self.device)


def model_parallel_seed(seed: int, *, tp_rank: int, device: torch.device | str = "cpu",
                        tracker: Optional[RNGStatesTracker] = None) -> RNGStatesTracker:
    """Seeds the default generator with ``seed`` (same on all tp ranks: replicated-region dropout) and the
    tracker's model-parallel state with ``seed + 2718 + tp_rank`` (partitioned-region dropout).

    Megatron's ``model_parallel_cuda_manual_seed``. Callers offset ``seed`` by pipeline (and, for
    data-parallel random init, data-parallel) rank before calling, as Megatron's training loop does.
    ``tracker`` is the layout's (``state.rng_tracker``), reset and reseeded; a new one for ``device`` when
    None. Returns it.
    """
    torch.manual_seed(seed)  # Seeds the CPU generator and every CUDA device's.
    tracker = tracker if tracker is not None else RNGStatesTracker(device)
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + tp_rank)
    return tracker


class _ReplayTrackerStates:
    """Snapshots the tracker's states at forward time and replays them while the checkpoint recomputes."""

    def __init__(self, tracker: RNGStatesTracker) -> None:
        self.tracker = tracker
        self.saved: Optional[dict[str, torch.Tensor]] = None

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        self.saved = self.tracker.get_states()
        yield

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        current = self.tracker.get_states()
        self.tracker.set_states(self.saved)
        self.tracker.recompute_depth += 1
        try:
            yield
        finally:
            self.tracker.recompute_depth -= 1
            self.tracker.set_states(current)


def checkpoint(
    function: Callable[..., Any], *args: Any, rng_tracker: Optional[RNGStatesTracker] = None, **kwargs: Any
) -> Any:
    """Runs ``function(*args, **kwargs)`` without keeping its activations; backward recomputes them.

    The recompute sees the same default-generator state (CPU and the inputs' device) and the same tracker
    states as the first forward, so dropout masks, replicated or tensor-parallel, are identical and the
    gradients equal those of running ``function`` without checkpointing. Built on PyTorch's non-reentrant
    checkpoint, so it composes with ``torch.autograd.grad`` and keyword arguments.
    """
    if torch.compiler.is_compiling():  # inside a compiled layer: dynamo traces the plain checkpoint (a higher-
        # order op) and inductor recomputes the region in backward; it cannot trace the tracker replay below
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
    if rng_tracker is None:  # only the default generator's state is replayed (torch's preserve_rng_state)
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True,
                                                 **kwargs)
    replay = _ReplayTrackerStates(rng_tracker)
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, preserve_rng_state=True,
        context_fn=lambda: (replay.forward(), replay.recompute()), **kwargs,
    )
