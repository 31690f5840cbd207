"""Shared fixtures: the multi-process pools live for the whole session and close at its end."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
import pytest
import torch

from megatron_core.testing import PoolCache


@pytest.fixture(scope="session")
def distributed():
    """``distributed(world_size, fn, *args, **kwargs)`` runs fn on that many gloo ranks; results by rank.
    The ranks are forked once per world size and reused by every test of the session."""
    with PoolCache() as pools:
        yield pools.run


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield
