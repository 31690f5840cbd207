"""WeightGradStore and the deferrable linear, in one process: B computes input and bias gradients only, W the
weight gradients, through the weights' grad accumulators (their hooks see the grads in W); results equal F.linear's
(fp32, with checkpointed recompute too); outside a schedule the linears run F.linear; a schedule that ends with
weight gradients still queued is an error."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megatron_core.tensor_parallel.weight_grad_store import WeightGradStore, linear_deferrable


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    weights = [torch.nn.Parameter(torch.randn(12, 8, generator=g)), torch.nn.Parameter(torch.randn(8, 12, generator=g))]
    biases = [torch.nn.Parameter(torch.randn(12, generator=g)), torch.nn.Parameter(torch.randn(8, generator=g))]
    return weights, biases


def _mlp(x, weights, biases, store):
    hidden = F.gelu(linear_deferrable(x, weights[0], biases[0], store))
    return linear_deferrable(hidden, weights[1], biases[1], store)


def _reference_grads(x, grad):
    weights, biases = _params()
    x = x.clone().requires_grad_()
    _mlp(x, weights, biases, None).backward(grad)
    return x.grad, [w.grad for w in weights], [b.grad for b in biases]


@pytest.mark.parametrize("recompute", [False, True])
def test_weight_gradients_wait_for_the_weight_pass(recompute):
    x, grad = torch.randn(5, 3, 8), torch.randn(5, 3, 8)
    ref_x, ref_w, ref_b = _reference_grads(x, grad)
    weights, biases = _params()
    fired = []
    for w in weights:
        w.register_post_accumulate_grad_hook(lambda p: fired.append((p, p.grad is not None)))
    store = WeightGradStore()
    x = x.clone().requires_grad_()
    with store.schedule(), store.deferrable_forward():
        out = (checkpoint(_mlp, x, weights, biases, store, use_reentrant=False) if recompute
               else _mlp(x, weights, biases, store))
        with store.backward_pass():
            out.backward(grad)
        assert all(w.grad is None for w in weights) and store.pending_passes == 1
        torch.testing.assert_close(x.grad, ref_x, rtol=1e-6, atol=1e-6)
        for b, ref in zip(biases, ref_b):  # bias grads come in B
            torch.testing.assert_close(b.grad, ref, rtol=1e-6, atol=1e-6)
        assert not any(has_grad for _, has_grad in fired)  # (torch calls the hooks of a None grad too)
        fired.clear()
        store.run_weight_pass()
    assert store.pending_passes == 0 and sorted(id(p) for p, has_grad in fired if has_grad) == sorted(map(id, weights))
    for w, ref in zip(weights, ref_w):
        torch.testing.assert_close(w.grad, ref, rtol=1e-6, atol=1e-6)


def test_outside_a_deferrable_forward_the_linear_is_f_linear():
    weights, biases = _params()
    store = WeightGradStore()
    out = linear_deferrable(torch.randn(2, 8, requires_grad=True), weights[0], biases[0], store)
    assert type(out.grad_fn).__name__ == "AddmmBackward0"
    with store.schedule():  # a forward whose backward runs whole
        out = linear_deferrable(torch.randn(2, 8, requires_grad=True), weights[0], biases[0], store)
        assert type(out.grad_fn).__name__ == "AddmmBackward0"
        out.sum().backward()


def test_backward_outside_a_backward_pass_computes_weight_gradients_at_once():
    weights, biases = _params()
    store = WeightGradStore()
    x, grad = torch.randn(4, 8), torch.randn(4, 8)
    ref_x, ref_w, _ = _reference_grads(x, grad)
    with store.schedule(), store.deferrable_forward():
        _mlp(x, weights, biases, store).backward(grad)
    for w, ref in zip(weights, ref_w):
        torch.testing.assert_close(w.grad, ref, rtol=1e-6, atol=1e-6)


def test_a_schedule_ending_with_queued_weight_gradients_is_an_error():
    weights, biases = _params()
    store = WeightGradStore()
    with pytest.raises(RuntimeError, match="1 backward pass"):
        with store.schedule(), store.deferrable_forward():
            with store.backward_pass():
                _mlp(torch.randn(4, 8), weights, biases, store).sum().backward()
    assert store.pending_passes == 0 and not store.active
    with pytest.raises(RuntimeError, match="no backward pass is waiting"):
        store.run_weight_pass()
