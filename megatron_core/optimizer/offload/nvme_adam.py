"""``NvmeAdam``: AdamW whose fp32 master weights and moments live in files (``--optimizer-nvme-offload-dir``,
DeepSpeed's ``offload_optimizer: {device: nvme}``), streamed through the update in fixed-size chunks.

The optimizer's pieces (see ``megatron_core.optimizer.optimizer``) are laid end to end in one flat fp32 space
per state; chunk ``k`` is the elements ``[k * C, (k + 1) * C)``. A step walks the chunks through a ring of
three host buffers: while chunk ``i`` is updated (``host_adam.adamw_`` on each piece's slice), a thread pool
reads chunk ``i + 1`` and writes chunk ``i - 1`` back. The buffers exist only during ``step()``, so the
resident optimizer state is at most three chunks (``3 * C * 12`` bytes) while the files hold all of it. On
CUDA the buffers are pinned, and the grads are copied to the host by the caller.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Optional, Sequence

import torch

from megatron_core.optimizer.offload.host_adam import AdamHyper, adamw_, fused_adamw_
from megatron_core.optimizer.offload.state_files import FP32_BYTES, StateFiles

STATES = ("master", "exp_avg", "exp_avg_sq")
RING = 3


@dataclasses.dataclass(frozen=True)
class _Chunk:
    start: int
    end: int
    segments: tuple[tuple[int, int, int, int], ...]  # (piece index, piece lo, piece hi, offset in the chunk)


class NvmeAdam:
    """AdamW over ``pieces`` with every fp32 master and moment in ``StateFiles``.

    Args:
        pieces: the optimizer's pieces (``.model`` a 1-D view, ``.master_grad`` the fp32 host grad at step
            time, ``.decay``); their masters are written to the files from ``.model`` now.
        directory: ``--optimizer-nvme-offload-dir``.
        rank: the global rank (names the per-rank folder).
        chunk_elements: elements per chunk (``--optimizer-nvme-chunk-elements``).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``; 1-D pieces get no weight decay.
        pin_memory: pin the ring buffers (CUDA only).
        fused: update with ``host_adam.fused_adamw_`` (fast) instead of ``host_adam.adamw_`` (bit-exact).
    """

    def __init__(self, pieces: Sequence[Any], *, directory: str, rank: int, chunk_elements: int, lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float, pin_memory: bool = False,
                 fused: bool = False) -> None:
        if chunk_elements < 1:
            raise ValueError(f"chunk_elements {chunk_elements} must be >= 1")
        self.pieces, self.chunk_elements, self.pin_memory = list(pieces), chunk_elements, pin_memory
        self.fused = fused
        self.offsets = [0]
        for piece in self.pieces:
            self.offsets.append(self.offsets[-1] + piece.model.numel())
        self.numel = self.offsets[-1]
        self.files = StateFiles(directory, rank=rank, sizes={name: FP32_BYTES * self.numel for name in STATES})
        self.steps = [0] * len(self.pieces)
        groups = [{"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                   "params": [i for i, p in enumerate(self.pieces) if p.decay]},
                  {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0,
                   "params": [i for i, p in enumerate(self.pieces) if not p.decay]}]
        self.param_groups = [g for g in groups if g["params"]]
        self.live_buffers: list[tuple[str, torch.Tensor]] = []  # (state, ring buffer) during step()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="nvme-adam")
        for index, piece in enumerate(self.pieces):
            self.write_piece_state(index, "master", piece.model)

    # ----------------------------------------------------------------------------------------------------------
    # chunks
    def _chunks(self, indices: set[int]) -> list[_Chunk]:
        """The chunks that hold elements of the pieces ``indices``, with those pieces' segments."""
        chunks: dict[int, list] = {}
        for index in sorted(indices):
            lo, hi = self.offsets[index], self.offsets[index + 1]
            for k in range(lo // self.chunk_elements, (hi - 1) // self.chunk_elements + 1 if hi > lo else 0):
                start = k * self.chunk_elements
                a, b = max(lo, start), min(hi, start + self.chunk_elements)
                chunks.setdefault(k, []).append((index, a - lo, b - lo, a - start))
        return [_Chunk(k * self.chunk_elements, min(self.numel, (k + 1) * self.chunk_elements), tuple(segs))
                for k, segs in sorted(chunks.items())]

    def _new_buffers(self) -> dict[str, torch.Tensor]:
        buffers = {name: torch.empty(self.chunk_elements, dtype=torch.float32, pin_memory=self.pin_memory)
                   for name in STATES}
        self.live_buffers.extend(buffers.items())
        return buffers

    def _read(self, chunk: _Chunk, buffers: dict[str, torch.Tensor]) -> None:
        for name in STATES:
            self.files.read(name, chunk.start, buffers[name][:chunk.end - chunk.start])

    def _write(self, chunk: _Chunk, buffers: dict[str, torch.Tensor]) -> None:
        for name in STATES:
            self.files.write(name, chunk.start, buffers[name][:chunk.end - chunk.start])

    def _hyper(self) -> list[AdamHyper]:
        """Each piece's settings now (the scheduler may have changed ``lr`` in ``param_groups``)."""
        hyper: list[Optional[AdamHyper]] = [None] * len(self.pieces)
        for group in self.param_groups:
            setting = AdamHyper(lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                                weight_decay=group["weight_decay"])
            for index in group["params"]:
                hyper[index] = setting
        return hyper

    def _update(self, chunk: _Chunk, buffers: dict[str, torch.Tensor], hyper: list[AdamHyper]) -> None:
        for index, lo, hi, at in chunk.segments:
            piece, window = self.pieces[index], slice(at, at + hi - lo)
            master, grad = buffers["master"][window], piece.master_grad[lo:hi]
            moments = buffers["exp_avg"][window], buffers["exp_avg_sq"][window]
            if self.fused:
                fused_adamw_([master], [grad], [moments[0]], [moments[1]], step=self.steps[index], hyper=hyper[index])
            else:
                adamw_(master, grad, *moments, step=self.steps[index], hyper=hyper[index])
            piece.model[lo:hi].copy_(master)

    # ----------------------------------------------------------------------------------------------------------
    # the step
    @torch.no_grad()
    def step(self) -> None:
        """Updates every piece that has a ``master_grad``: reads, updates and writes back chunk by chunk, the
        read of chunk i+1 and the write of chunk i-1 overlapping the update of chunk i; writes the new
        values into each piece's ``model`` view."""
        indices = {i for i, piece in enumerate(self.pieces) if piece.master_grad is not None}
        for index in indices:
            self.steps[index] += 1
        chunks, hyper = self._chunks(indices), self._hyper()
        ring = [self._new_buffers() for _ in range(min(RING, len(chunks)))]
        reads, writes = {}, {}
        try:
            if chunks:
                reads[0] = self._pool.submit(self._read, chunks[0], ring[0])
            for i, chunk in enumerate(chunks):
                if i + 1 < len(chunks):
                    if i - 2 in writes:  # chunk i+1 reuses chunk i-2's buffers
                        writes.pop(i - 2).result()
                    reads[i + 1] = self._pool.submit(self._read, chunks[i + 1], ring[(i + 1) % RING])
                reads.pop(i).result()
                self._update(chunk, ring[i % RING], hyper)
                writes[i] = self._pool.submit(self._write, chunk, ring[i % RING])
        finally:
            for future in list(reads.values()) + list(writes.values()):
                future.result()
            self.live_buffers.clear()

    # ----------------------------------------------------------------------------------------------------------
    # states, one piece at a time (checkpoints)
    def read_piece_state(self, index: int, name: str) -> torch.Tensor:
        """A new fp32 tensor with state ``name`` of piece ``index``."""
        out = torch.empty(self.offsets[index + 1] - self.offsets[index], dtype=torch.float32)
        self.files.read(name, self.offsets[index], out)
        return out

    def write_piece_state(self, index: int, name: str, values: torch.Tensor) -> None:
        """Stores ``values`` (any dtype and device, the piece's numel) as state ``name`` of piece ``index``."""
        expected = self.offsets[index + 1] - self.offsets[index]
        if values.numel() != expected:
            raise ValueError(f"state {name!r} of piece {index} has {values.numel()} elements, expected {expected}")
        # a copy: the I/O exposes the bytes to numpy, which would pin the caller's storage (not resizable)
        self.files.write(name, self.offsets[index], values.detach().reshape(-1).to("cpu", torch.float32, copy=True))

    def state_bytes(self) -> dict[str, int]:
        """Bytes held in the files: ``{"master_weights": ..., "optimizer_states": ...}``."""
        return {"master_weights": self.numel * FP32_BYTES, "optimizer_states": 2 * self.numel * FP32_BYTES}

    def state_dict(self) -> dict:
        """``torch.optim.AdamW.state_dict()``'s form (pieces numbered in order), read from the files."""
        state = {i: {"step": torch.tensor(float(s)), "exp_avg": self.read_piece_state(i, "exp_avg"),
                     "exp_avg_sq": self.read_piece_state(i, "exp_avg_sq")} for i, s in enumerate(self.steps) if s}
        groups = [{k: v for k, v in g.items()} for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores ``state_dict()`` (into the files)."""
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.steps = [0] * len(self.pieces)
        for index, values in state_dict["state"].items():
            self.steps[int(index)] = int(float(values["step"]))
            for name in ("exp_avg", "exp_avg_sq"):
                self.write_piece_state(int(index), name, values[name])

    def close(self) -> None:
        """Stops the I/O threads and removes the files."""
        self._pool.shutdown(wait=True)
        self.files.close()
