"""The model's hot path (norms, vocab-parallel loss; attention runs SDPA) runs the fused Triton kernels when they can run: here under
the interpreter (tests/conftest.py sets TRITON_INTERPRET=1), on a GPU compiled. Tiny shapes: each launch is
interpreted."""
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
    state = initialize_model_parallel()
    model = build_model(tiny_config(num_layers=1, **overrides), state)
    input_ids, positions, labels = make_batch(batch=1, seq=4)
    kernels.clear_backend_report()
    with kernels.use_backend("auto"):
        loss = model(input_ids, positions, labels=labels)
        loss.sum().backward()
    assert kernels.last_backend("attention") == "sdpa"  # causal without a mask: SDPA; the softmax serves masks
    assert kernels.last_backend(norm_op) == "triton"
    assert kernels.last_backend("cross_entropy_shard_stats") == "triton"
    assert kernels.last_backend("cross_entropy_shard_backward") == "triton"
    with kernels.use_backend("torch"):
        reference = build_model(tiny_config(num_layers=1, **overrides), state)(input_ids, positions, labels=labels)
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-5)
