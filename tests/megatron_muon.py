"""megatron-core 0.16.1's own ``TensorParallelMuon`` on NVIDIA's Emerging-Optimizers 0.3.0 (the only release on
PyPI), the reference our Muon is tested against. Two keyword renames between those releases are bridged, the
math is theirs: ``OrthogonalizedOptimizer(use_nesterov=)`` became ``nesterov=`` and ``newton_schulz_tp(mode=)``
became ``tp_mode=``. Emerging-Optimizers imports ``typing.override`` (Python 3.12); on 3.11 it is
``typing_extensions.override``, the same decorator."""
from __future__ import annotations

import functools
import typing
import warnings
from types import SimpleNamespace

import typing_extensions

if not hasattr(typing, "override"):
    typing.override = typing_extensions.override

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core: "Transformer Engine and Apex are not installed"
    import megatron.core.optimizer.muon as megatron_muon
from emerging_optimizers.orthogonalized_optimizers import (
    muon_utils,  # noqa: E402
    orthogonalized_optimizer,  # noqa: E402
)

_BASE_INIT = orthogonalized_optimizer.OrthogonalizedOptimizer.__init__


@functools.wraps(_BASE_INIT)
def _init(self, params, lr, momentum, *args, use_nesterov=None, **kwargs):
    if use_nesterov is not None:
        kwargs["nesterov"] = use_nesterov
    _BASE_INIT(self, params, lr, momentum, *args, **kwargs)


def _newton_schulz_tp(x, steps, coefficient_type, tp_group, partition_dim=None, mode="duplicated"):
    return muon_utils.newton_schulz_tp(x, steps, coefficient_type, tp_group, partition_dim, tp_mode=mode)


orthogonalized_optimizer.OrthogonalizedOptimizer.__init__ = _init
megatron_muon.newton_schulz_tp = _newton_schulz_tp
newton_schulz = muon_utils.newton_schulz


def tensor_parallel_muon(params, *, tp_group=None, qkv_split_shapes=None, **kwargs):
    """Megatron's ``TensorParallelMuon`` over ``params`` (marked ``is_qkv`` where they are a QKV weight)."""
    collection = SimpleNamespace(tp=tp_group, expt_tp=tp_group) if tp_group is not None else None
    return megatron_muon.TensorParallelMuon(
        params, pg_collection=collection, split_qkv=qkv_split_shapes is not None,
        is_qkv_fn=lambda p: getattr(p, "is_qkv", False), qkv_split_shapes=qkv_split_shapes, **kwargs)
