"""The loss curve of a run as a PNG (matplotlib, Agg canvas): training loss per iteration, validation points,
the learning rate on a second axis, and the layout in the title."""
from __future__ import annotations

from typing import Optional, Sequence

from megatron_core.utils.files import new_figure, save_figure


def write_loss_curve_png(losses: Sequence[float], path: str, *, first_iteration: int = 1,
                         lrs: Optional[Sequence[float]] = None,
                         valid: Sequence[tuple[int, float]] = (), title: str = "training loss") -> None:
    """Draws the loss curve into a PNG at ``path``.

    Args:
        losses: training loss of each iteration, starting at ``first_iteration``.
        lrs: learning rate of each iteration (same length as ``losses``), drawn on a right-hand axis.
        valid: ``(iteration, validation loss)`` points.
        title: e.g. the layout (``tp 2 x pp 2 x dp 1, 150 iterations``).
    """
    iterations = list(range(first_iteration, first_iteration + len(losses)))
    figure = new_figure(8.0, 4.5)
    ax = figure.add_subplot()
    ax.plot(iterations, list(losses), color="tab:blue", linewidth=1.2, label="train loss")
    if valid:
        ax.plot([i for i, _ in valid], [v for _, v in valid], "o--", color="tab:orange", markersize=6,
                label="validation loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if lrs is not None and len(lrs) == len(losses):
        lr_axis = ax.twinx()
        lr_axis.plot(iterations, list(lrs), color="tab:gray", linewidth=1.0, linestyle=":", label="learning rate")
        lr_axis.set_ylabel("learning rate")
        from matplotlib.ticker import FormatStrFormatter
        lr_axis.yaxis.set_major_formatter(FormatStrFormatter("%.1e"))
        more_handles, more_labels = lr_axis.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    ax.legend(handles, labels, loc="upper right")
    ax.set_title(title)
    save_figure(figure, path)
