"""Atomic file writes (pictures, traces): readers never see a half-written file."""
from __future__ import annotations

from megatron_core.utils.durable import write_atomically


def atomic_write(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` atomically (``utils/durable.py``; no fsync: pictures and traces)."""
    write_atomically(path, data, durable=False)


def save_figure(figure, path: str, *, dpi: int = 110) -> None:
    """Saves a matplotlib ``Figure`` as a PNG at ``path``, atomically. The figure is drawn by the Agg canvas
    it is attached to (no global pyplot state, no display needed)."""
    import io

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    atomic_write(path, buffer.getvalue())


def new_figure(width: float, height: float):
    """A matplotlib ``Figure`` on an Agg canvas (object API: nothing global, works without a display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height))
    FigureCanvasAgg(figure)
    return figure
