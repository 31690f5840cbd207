"""The loss curve as a PNG (no plotting library): grey axes, light grid lines at each tenth of the range,
the loss as a blue polyline; iteration on x, loss on y (min at the bottom, max at the top)."""
from __future__ import annotations

from typing import Sequence

from megatron_core.utils.png import atomic_write, encode_png

WIDTH, HEIGHT, MARGIN = 800, 400, 20


def _line(pixels, x0: int, y0: int, x1: int, y1: int, color) -> None:
    steps = max(abs(x1 - x0), abs(y1 - y0), 1)
    for i in range(steps + 1):
        x, y = round(x0 + (x1 - x0) * i / steps), round(y0 + (y1 - y0) * i / steps)
        for dy in (0, 1):
            if 0 <= y + dy < HEIGHT and 0 <= x < WIDTH:
                pixels[y + dy][x] = color


def write_loss_curve_png(losses: Sequence[float], path: str, *, first_iteration: int = 1) -> None:
    """Draws ``losses`` (one per iteration from ``first_iteration``) into an 800x400 PNG at ``path``."""
    pixels = [[(255, 255, 255)] * WIDTH for _ in range(HEIGHT)]
    low, high = min(losses), max(losses)
    span = (high - low) or 1.0
    for tenth in range(11):
        y = MARGIN + round((HEIGHT - 2 * MARGIN) * tenth / 10)
        _line(pixels, MARGIN, y, WIDTH - MARGIN, y, (235, 235, 235))
    _line(pixels, MARGIN, MARGIN, MARGIN, HEIGHT - MARGIN, (120, 120, 120))
    _line(pixels, MARGIN, HEIGHT - MARGIN, WIDTH - MARGIN, HEIGHT - MARGIN, (120, 120, 120))
    count = max(len(losses) - 1, 1)
    points = [(MARGIN + round((WIDTH - 2 * MARGIN) * i / count),
               HEIGHT - MARGIN - round((HEIGHT - 2 * MARGIN) * (loss - low) / span)) for i, loss in enumerate(losses)]
    for (x0, y0), (x1, y1) in zip(points, points[1:] or points):
        _line(pixels, x0, y0, x1, y1, (66, 133, 244))
    atomic_write(path, encode_png(pixels))
