"""The text of a request's generated tokens as it grows: what is safe to stream so far, and stop strings."""
from __future__ import annotations

from typing import Callable, Collection, Optional, Sequence


class TextStream:
    """Incremental detokenization of one request (rank 0).

    Each ``push`` decodes all generated tokens (so multi-token characters and word joins come out right) and
    returns the new text that can no longer change: a trailing replacement character (an unfinished UTF-8
    sequence) and a tail that could still grow into a stop string are held back.

    Args:
        decode: ids -> text (the tokenizer's).
        stop: stop strings; the text ends before the first one found.
        hidden_ids: ids never shown as text (the end-of-document token, stop token ids).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = (),
                 hidden_ids: Collection[int] = ()) -> None:
        self.decode, self.stop, self.hidden_ids = decode, tuple(stop), frozenset(hidden_ids)
        self.emitted = ""  # the text returned so far

    def _text(self, tokens: Sequence[int]) -> str:
        return self.decode([t for t in tokens if t not in self.hidden_ids])

    def _first_stop(self, text: str) -> Optional[int]:
        start = max(0, len(self.emitted) - max((len(s) for s in self.stop), default=0))
        found = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _held_back(self, text: str) -> int:
        hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        trailing = len(text) - len(text.rstrip("\ufffd"))
        return max(hold, trailing)

    def push(self, tokens: Sequence[int]) -> tuple[str, bool]:
        """``tokens``: every generated token so far. Returns ``(new final text, whether a stop string ended
        it)``; after a stop the text is complete (cut before the stop string)."""
        text = self._text(tokens)
        cut = self._first_stop(text)
        if cut is not None:
            end = max(cut, len(self.emitted))
            return self._emit(text[:end]), True
        return self._emit(text[:max(len(text) - self._held_back(text), len(self.emitted))]), False

    def finish(self, tokens: Sequence[int]) -> str:
        """The rest of the text when the request ends for another reason (nothing held back)."""
        text = self._text(tokens)
        cut = self._first_stop(text)
        return self._emit(text if cut is None else text[:max(cut, len(self.emitted))])

    def _emit(self, final: str) -> str:
        delta = final[len(self.emitted):]  # (a decode that rewrote already-emitted text cannot be taken back)
        self.emitted += delta
        return delta


__all__ = ["TextStream"]
