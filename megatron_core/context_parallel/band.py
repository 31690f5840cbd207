"""Sliding-window attention for the block kernels (``blocks``): a ``Band`` holds the global positions of a
block's query rows and key columns and the window ``(left, right)``. ``blocks`` masks every key outside
``[p - left, p + right]`` of a query at position p, and ``band_tiles`` plans the query-row tiles so that each
computes only the key columns some row of it can see: a windowed layer costs about ``s * window`` scores,
not ``s^2``. Pure indexing on the host (the planning) and one comparison per tile on the device; no
communication here.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch


def normalize_window(window: Optional[Sequence[int]]) -> Optional[tuple[int, int]]:
    """``(left, right)`` with -1 for an unbounded side, or None when neither side bounds anything (no window)."""
    if window is None:
        return None
    left, right = (int(w) for w in window)
    return None if left < 0 and right < 0 else (left, right)


@dataclasses.dataclass(frozen=True)
class Band:
    """The window of one block: query row i (position ``q_pos[i]``) sees key column j (position ``k_pos[j]``)
    only when ``q_pos[i] - left <= k_pos[j] <= q_pos[i] + right`` (-1: that side unbounded).

    ``q_pos`` ``[sq]`` and ``k_pos`` ``[sk]`` are int64 on the scores' device, each ascending; ``q_host`` and
    ``k_host`` are their CPU copies, read by the tile planning (no device synchronization)."""

    q_pos: torch.Tensor
    k_pos: torch.Tensor
    left: int
    right: int
    q_host: torch.Tensor
    k_host: torch.Tensor

    @classmethod
    def of(cls, q_pos: torch.Tensor, k_pos: torch.Tensor, window: tuple[int, int], device) -> "Band":
        """From CPU int64 positions ``[sq]``, ``[sk]`` (ascending) and ``window = (left, right)``."""
        q_host, k_host = q_pos.to("cpu", torch.int64), k_pos.to("cpu", torch.int64)
        return cls(q_host.to(device), k_host.to(device), int(window[0]), int(window[1]), q_host, k_host)

    def key_range(self, start: int, end: int) -> tuple[int, int]:
        """Key columns ``[lo, hi)`` that some query row in ``[start, end)`` may see (``hi <= lo``: none)."""
        lo, hi = 0, self.k_host.numel()
        if self.left >= 0:
            lo = int(torch.searchsorted(self.k_host, self.q_host[start] - self.left))
        if self.right >= 0:
            hi = int(torch.searchsorted(self.k_host, self.q_host[end - 1] + self.right, right=True))
        return lo, hi

    def mask(self, start: int, end: int, lo: int, hi: int) -> Optional[torch.Tensor]:
        """Boolean ``[end - start, hi - lo]``, True where query row ``start + i`` must not see key ``lo + j``."""
        q, k = self.q_pos[start:end, None], self.k_pos[None, lo:hi]
        outside = None
        if self.left >= 0:
            outside = k < q - self.left
        if self.right >= 0:
            after = k > q + self.right
            outside = after if outside is None else outside | after
        return outside


def band_tiles(band: Band, *, sq: int, row_cost: int, tile_elements: int, causal: bool,
               causal_offset: int) -> list[tuple[int, int, int, int]]:
    """``(row start, row end, key lo, key hi)`` tiles covering the ``sq`` query rows, each computing at most
    about ``tile_elements`` scores (``rows * (hi - lo) * row_cost``, row_cost = batch x heads; at least one
    row). ``causal``: row i also sees no key column after ``i + causal_offset``."""

    def columns(start: int, end: int) -> tuple[int, int]:
        lo, hi = band.key_range(start, end)
        if causal:
            hi = min(hi, end + causal_offset)
        return lo, max(lo, hi)

    def fits(start: int, end: int) -> bool:
        lo, hi = columns(start, end)
        return (end - start) * max(1, hi - lo) * row_cost <= tile_elements

    tiles, start, rows = [], 0, 1
    while start < sq:
        rows = min(rows, sq - start)
        while rows > 1 and not fits(start, start + rows):
            rows //= 2
        while start + rows < sq and fits(start, start + min(sq - start, 2 * rows)):
            rows = min(sq - start, 2 * rows)
        tiles.append((start, start + rows, *columns(start, start + rows)))
        start += rows
    return tiles


__all__ = ["Band", "band_tiles", "normalize_window"]
