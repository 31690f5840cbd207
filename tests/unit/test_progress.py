"""Progress bars (tqdm) are drawn on a terminal only, and never with ``enabled=False`` (``--no-progress``)."""
import io
import sys

from megatron_core.utils.progress import progress_bar


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _draw(monkeypatch, stream, enabled):
    monkeypatch.setattr(sys, "stderr", stream)
    assert list(progress_bar(range(5), desc="converting", enabled=enabled)) == list(range(5))
    return stream.getvalue()


def test_bar_drawn_on_a_terminal(monkeypatch):
    assert "converting" in _draw(monkeypatch, _Terminal(), True)


def test_no_bar_off_a_terminal_or_when_disabled(monkeypatch):
    assert _draw(monkeypatch, io.StringIO(), True) == ""
    assert _draw(monkeypatch, _Terminal(), False) == ""
