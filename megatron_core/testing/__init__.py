"""Testing helpers: run functions on several gloo ranks of this machine (see ``multiprocess``)."""
from megatron_core.testing.multiprocess import (
    DistributedPool,
    DistributedRunError,
    PoolCache,
    run_distributed,
)

__all__ = ["DistributedPool", "DistributedRunError", "PoolCache", "run_distributed"]
