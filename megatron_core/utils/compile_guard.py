"""``torch.compiler.disable`` without importing ``torch._dynamo`` where the decorated function is defined.

``torch.compiler.disable`` imports ``torch._dynamo`` and with it sympy and the FX tracer: 2 s of the 5 s that
``pretrain_gpt.py --help`` took on a 2-core CPU, paid at ``import megatron_core`` by every process, including
those that never run a step (``--help``, the tools, a run refused for a bad flag). ``eager_when_compiled``
uses torch's own deferred form, ``torch._compile._disable_dynamo`` (what ``torch.optim`` decorates its
methods with, for the same reason): the disabled function is made at the first call. Inside ``torch.compile``
the function then runs eagerly behind a graph break, as under the plain decorator. A torch without that form
gets the plain decorator.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch
import torch._compile

F = TypeVar("F", bound=Callable)


def eager_when_compiled(fn: F) -> F:
    """``fn``, run eagerly inside ``torch.compile`` (``torch.compiler.disable``), with ``torch._dynamo``
    imported at its first call instead of here."""
    deferred = getattr(torch._compile, "_disable_dynamo", None)
    return deferred(fn) if deferred is not None else torch.compiler.disable(fn)


__all__ = ["eager_when_compiled"]
