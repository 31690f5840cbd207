"""Blocked cross-entropy under the Triton interpreter: against the torch reference and F.cross_entropy,
fp32/bf16/fp16, a vocab not a power of two, label smoothing, ignore_index, extreme logits, the vocab-shard
pieces, and the vocab-parallel loss dispatching to the kernel."""
import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import xentropy as ce_module
from megatron_core.tensor_parallel import vocab_parallel_cross_entropy
from tests.kernels._helpers import DTYPES, TOL, assert_close_all, requires_triton, run, torch_op

pytestmark = requires_triton

VOCAB = 97


def _inputs(dtype, vocab=VOCAB, scale=3.0):
    logits = (torch.randn(2, 3, vocab) * scale).to(dtype)
    target = torch.randint(0, vocab, (2, 3))
    target[0, 0], target[0, 1], target[1, 2] = 0, vocab - 1, -100  # first / last entry, one ignored token
    return logits, target, torch.rand(2, 3) + 0.5


def _torch_ce(logits, target, label_smoothing):
    return F.cross_entropy(logits.flatten(0, -2), target.flatten(), reduction="none",
                           label_smoothing=label_smoothing).view(target.shape)


def _check(logits, target, grad_loss, label_smoothing, tol):
    fn = lambda x, **k: kernels.cross_entropy(x, target, label_smoothing=label_smoothing, **k)  # noqa: E731
    loss, grads, used = run(fn, (logits,), grad_loss, "triton")
    assert used["cross_entropy_shard_stats"] == "triton"
    assert used["cross_entropy_shard_backward"] == "triton"
    assert loss.dtype == torch.float32 and grads[0].dtype == logits.dtype
    ref_loss, ref_grads, used = run(fn, (logits,), grad_loss, "torch")
    assert_close_all([loss, *grads], [ref_loss, *ref_grads], tol, "vs reference")
    torch_loss, torch_grads = torch_op(lambda x: _torch_ce(x, target, label_smoothing), (logits,), grad_loss)
    assert_close_all([loss, *grads], [torch_loss, *torch_grads], tol, "vs F.cross_entropy")
    return loss, grads


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference_and_torch(dtype, label_smoothing):
    logits, target, grad_loss = _inputs(dtype)
    loss, (grad,) = _check(logits, target, grad_loss, label_smoothing, TOL[dtype])
    assert loss[1, 2] == 0 and (grad[1, 2] == 0).all(), "ignore_index gives zero loss and gradient"


def test_extreme_logits():
    logits, target, grad_loss = _inputs(torch.float32, vocab=19, scale=1e4)  # any unshifted exp overflows
    logits[1, 0] = -1e30  # a row of uniformly, hugely negative logits
    logits[1, 1, 3:9] = float("-inf")  # masked-out vocab entries
    target[1, 1] = 2
    _check(logits, target, grad_loss, 0.0, dict(rtol=1e-6, atol=1e-5))
    _check(logits[:, :1].contiguous(), target[:, :1], grad_loss[:, :1], 0.1, dict(rtol=1e-6, atol=1e-5))


def test_looped_path_over_vocab_blocks(monkeypatch):
    monkeypatch.setattr(ce_module, "_MAX_BLOCK", 16)  # vocab 97 -> seven blocks
    logits, target, grad_loss = _inputs(torch.float32)
    _check(logits, target, grad_loss, 0.1, TOL[torch.float32])


def test_shard_pieces_combine_to_the_full_loss_and_write_in_place():
    logits, target, grad_loss = _inputs(torch.float32, vocab=40)
    target[1, 2] = 7
    shards, eps = logits.chunk(2, dim=-1), 0.1
    stats = [kernels.cross_entropy_shard_stats(s, target, vocab_start=20 * i, with_shifted_sum=True)
             for i, s in enumerate(shards)]
    row_max = torch.maximum(stats[0].row_max, stats[1].row_max)
    stats = [s.rebase(row_max) for s in stats]
    sum_exp = stats[0].sum_exp + stats[1].sum_exp
    loss = kernels.cross_entropy_loss_from_stats(row_max, sum_exp, stats[0].target_logit + stats[1].target_logit,
                                                 stats[0].shifted_sum + stats[1].shifted_sum, vocab_size=40,
                                                 label_smoothing=eps)
    torch_loss, (torch_grad,) = torch_op(lambda x: _torch_ce(x, target, eps), (logits,), grad_loss)
    torch.testing.assert_close(loss.view(target.shape), torch_loss, rtol=1e-6, atol=1e-6)
    for i, shard in enumerate(shards):
        buffer = shard.contiguous()
        out = kernels.cross_entropy_shard_backward(buffer, target, row_max, sum_exp, grad_loss, vocab_start=20 * i,
                                                   vocab_size=40, label_smoothing=eps, out=buffer)
        assert out is buffer
        torch.testing.assert_close(buffer, torch_grad[..., 20 * i:20 * (i + 1)], rtol=1e-5, atol=1e-6)


def _vocab_parallel(logits, target, *, backend):
    return vocab_parallel_cross_entropy(logits, target, kernel_backend=backend)


def test_vocab_parallel_cross_entropy_dispatches_to_the_kernel():
    logits, target, grad_loss = _inputs(torch.float32, vocab=16)
    target[1, 2] = 3
    loss, (grad,), used = run(_vocab_parallel, (logits, target), grad_loss, "triton")
    assert used["cross_entropy_shard_stats"] == "triton"
    assert used["cross_entropy_shard_backward"] == "triton"
    ref_loss, (ref_grad,), used = run(_vocab_parallel, (logits, target), grad_loss, "torch")
    assert used["cross_entropy_shard_stats"] == "torch"
    assert_close_all([loss, grad], [ref_loss, ref_grad], TOL[torch.float32], "triton vs torch backend")


@pytest.mark.parametrize("call, fragment", [
    (lambda: kernels.cross_entropy(torch.randn(2, 8), torch.tensor([0, 8])),
     r"\[0, 8\) or equal ignore_index=-100, got values in \[8, 8\]"),
    (lambda: kernels.cross_entropy(torch.randn(2, 8), torch.zeros(3, dtype=torch.long)),
     r"logits shape \(2, 8\) does not match target shape \(3,\)"),
    (lambda: kernels.cross_entropy(torch.randn(2, 8), torch.zeros(2)),
     "target must be int64 or int32, got dtype torch.float32"),
    (lambda: kernels.cross_entropy(torch.randn(2, 8), torch.zeros(2, dtype=torch.long), label_smoothing=1.0),
     r"\[0, 1\), got 1.0"),
])
def test_bad_input_raises_value_error(call, fragment):
    with pytest.raises(ValueError, match=fragment):
        call()
