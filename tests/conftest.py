"""Shared fixtures: the multi-process pools live for the whole session and close at its end."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
import pytest
import torch

from megatron_core.testing import PoolCache


@pytest.fixture(scope="session")
def distributed():
    """``distributed(world_size, fn, *args, **kwargs)`` runs fn on that many gloo ranks; results by rank.
    The ranks are forked once per world size and reused by every test of the session, after this process
    imported what every training run imports (``tests.fork_server.PRELOAD``: torch._dynamo, which the first
    optimizer imports, and the training loop): about 3 s once here instead of in each of the 7 ranks."""
    import importlib

    from tests.fork_server import PRELOAD
    for module in PRELOAD:
        importlib.import_module(module)
    with PoolCache() as pools:
        yield pools.run


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield
