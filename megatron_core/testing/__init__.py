"""Testing helpers: run functions on several gloo ranks of this machine (see ``multiprocess``)."""
from megatron_core.testing.multiprocess import (
    DistributedPool,
    DistributedRunError,
    close_all_pools,
    get_pool,
    run_distributed,
)

__all__ = ["DistributedPool", "DistributedRunError", "close_all_pools", "get_pool", "run_distributed"]
