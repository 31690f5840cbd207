"""The model's hot path (norms, vocab-parallel loss; attention runs SDPA) runs the fused Triton kernels of its
layout's kernel backend: here in mode "triton" under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1),
on a GPU compiled in mode "auto". Tiny shapes: each launch is interpreted."""
import pytest
import torch

import kernels
from megatron_core import initialize_model_parallel
from tests.model_helpers import build_model, make_batch, tiny_config

pytestmark = pytest.mark.skipif(kernels.triton_unavailable_reason(torch.device("cpu")) is not None,
                                reason="Triton cannot run CPU tensors here (TRITON_INTERPRET unset)")


@pytest.mark.parametrize("overrides, norm_op", [
    ({}, "layer_norm"),
    (dict(normalization="RMSNorm", position_embedding_type="rope"), "rms_norm"),
])
def test_forward_and_backward_dispatch_to_triton(overrides, norm_op):
    state = initialize_model_parallel(kernel_backend="triton")
    model = build_model(tiny_config(num_layers=1, **overrides), state)
    input_ids, positions, labels = make_batch(batch=1, seq=4)
    loss = model(input_ids, positions, labels=labels)
    loss.sum().backward()
    used = state.kernel_backend.report()
    assert used["attention"] == "sdpa"  # causal without a mask: SDPA; the softmax serves masks
    assert used[norm_op] == "triton"
    assert used["cross_entropy_shard_stats"] == "triton" and used["cross_entropy_shard_backward"] == "triton"
    torch_state = initialize_model_parallel(kernel_backend="torch")
    reference = build_model(tiny_config(num_layers=1, **overrides), torch_state)(input_ids, positions, labels=labels)
    assert set(torch_state.kernel_backend.report().values()) <= {"torch", "sdpa"}
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-5)


def test_auto_runs_torch_on_the_cpu_and_each_state_records_its_own():
    """Mode "auto" never runs the Triton interpreter on the CPU (it is a testing tool, not a fast path), and the
    record is per layout: no process-wide backend report."""
    auto, other = initialize_model_parallel(), initialize_model_parallel(kernel_backend="triton")
    input_ids, positions, labels = make_batch(batch=1, seq=4)
    build_model(tiny_config(num_layers=1), auto)(input_ids, positions, labels=labels).sum().backward()
    assert auto.kernel_backend.report()["layer_norm"] == "torch"
    assert other.kernel_backend.report() == {}
