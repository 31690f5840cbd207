"""Installing us must not remove NVIDIA's Megatron (issue 15, part 6): our distribution name differs from
``megatron-core`` after pip's name normalization, and both packages import side by side."""
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _normalized(name: str) -> str:
    """PEP 503: what pip compares."""
    return re.sub(r"[-_.]+", "-", name).lower()


def test_distribution_name_is_not_nvidias():
    name = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[-1]
    assert _normalized(name) != _normalized("megatron-core"), name
    assert _normalized(name) == "megatron-core-3d"


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                    reason="NVIDIA's megatron-core is not installed (pip install megatron-core==0.16.1)")
def test_both_import_side_by_side():
    import megatron.core

    import megatron_core
    assert os.path.dirname(os.path.dirname(os.path.abspath(megatron_core.__file__))) == ROOT
    # NVIDIA's package comes from its installed distribution, not from this checkout's source tree
    assert not os.path.abspath(megatron.core.__file__).startswith(os.path.join(ROOT, "megatron_core"))
    assert "site-packages" in os.path.abspath(megatron.core.__file__) or "dist-packages" in megatron.core.__file__
    versions = {dist.version for dist in importlib.metadata.distributions() if dist.metadata["Name"] and
                _normalized(dist.metadata["Name"]) == "megatron-core"}
    assert "0.16.1" in versions
    from megatron.core import parallel_state  # noqa: F401 - its own modules resolve, not ours
    assert megatron_core.ParallelState.__module__ == "megatron_core.parallel_state"
