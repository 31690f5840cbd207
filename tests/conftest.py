"""Shared fixtures: the multi-process pools live for the whole session and close at its end."""
import os
os.environ.setdefault("TRITON_INTERPRET", "1")
import pytest
import torch

from megatron_core.testing import close_all_pools, run_distributed


@pytest.fixture(scope="session", autouse=True)
def _close_pools_at_session_end():
    yield
    close_all_pools()


@pytest.fixture
def distributed():
    """``distributed(world_size, fn, *args, **kwargs)`` runs fn on that many gloo ranks; results by rank."""
    return run_distributed


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield
