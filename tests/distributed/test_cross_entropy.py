"""vocab_parallel_cross_entropy at tp 1, 2, 4 equals F.cross_entropy over the full logits: loss and logits
gradient, with label smoothing, a padded vocab and extreme logits (fp32)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import kernels
from megatron_core import destroy_model_parallel, initialize_model_parallel
from megatron_core.tensor_parallel import vocab_parallel_cross_entropy, vocab_size_with_padding

B, S = 3, 5


def _inputs(vocab, scale, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, S, vocab, generator=g) * scale
    target = torch.randint(0, vocab, (B, S), generator=g)
    target[0, 0], target[0, 1] = 0, vocab - 1  # first and last vocab entry (first and last shard)
    grad_loss = torch.rand(B, S, generator=g) + 0.5
    return logits, target, grad_loss


def _reference(logits, target, grad_loss, label_smoothing):
    logits = logits.clone().requires_grad_()
    loss = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none",
                           label_smoothing=label_smoothing).view(target.shape)
    loss.backward(grad_loss)
    return loss.detach(), logits.grad


def _parallel(vocab, scale, label_smoothing):
    state = initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    logits, target, grad_loss = _inputs(vocab, scale)
    shard = logits.chunk(state.tp_size, dim=-1)[state.tp_rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, target, tp_group=state.tp_group, label_smoothing=label_smoothing)
    loss.backward(grad_loss)
    destroy_model_parallel(state)
    return loss.detach(), shard.grad


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("vocab, scale", [
    (16, 3.0),
    (vocab_size_with_padding(50, make_vocab_size_divisible_by=4, tensor_model_parallel_size=4), 3.0),  # 64
    (16, 1e4),  # extreme logits: any unshifted exp overflows
], ids=["plain", "padded-vocab", "extreme-logits"])
def test_matches_torch_cross_entropy(distributed, tp, label_smoothing, vocab, scale):
    logits, target, grad_loss = _inputs(vocab, scale)
    ref_loss, ref_grad = _reference(logits, target, grad_loss, label_smoothing)
    assert torch.isfinite(ref_loss).all()
    for rank, (loss, grad) in enumerate(distributed(tp, _parallel, vocab, scale, label_smoothing)):
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-5, msg=lambda m: f"loss rank {rank}: {m}")
        torch.testing.assert_close(grad, ref_grad.chunk(tp, -1)[rank], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"grad rank {rank}: {m}")


def test_single_process_half_precision_logits_keep_their_dtype():
    logits, target, grad_loss = _inputs(16, 3.0)
    half = logits.to(torch.bfloat16).requires_grad_()
    loss = vocab_parallel_cross_entropy(half, target)
    assert loss.dtype == torch.float32
    loss.backward(grad_loss)
    assert half.grad.dtype == torch.bfloat16
    ref_loss, ref_grad = _reference(half.detach().float(), target, grad_loss, 0.0)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(half.grad.float(), ref_grad, rtol=1e-2, atol=1e-2)


def test_input_logits_are_not_modified():
    logits, target, _ = _inputs(16, 3.0)
    before = logits.clone()
    vocab_parallel_cross_entropy(logits, target)
    assert torch.equal(logits, before)


@pytest.mark.skipif(kernels.triton_unavailable_reason(torch.device("cpu")) is not None,
                    reason="needs the Triton interpreter (the fused path; one fp32 rank runs F.cross_entropy)")
def test_second_backward_raises():
    logits, target, _ = _inputs(16, 3.0)
    logits.requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, target, kernel_backend=kernels.KernelBackend("triton")).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="cannot run twice"):
        loss.backward()


@pytest.mark.parametrize("make_input, fragment", [
    (lambda: (torch.randn(2, 3, 8), torch.tensor([[0, 1, 8], [0, 0, 0]])),
     r"target must lie in \[0, 8\), got values in \[0, 8\]"),
    (lambda: (torch.randn(2, 3, 8), torch.tensor([[0, -1, 2], [0, 0, 0]])), r"got values in \[-1, 2\]"),
    (lambda: (torch.randn(2, 3, 8), torch.zeros(3, 2, dtype=torch.long)),
     r"logits shape \(2, 3, 8\) does not match target shape \(3, 2\)"),
])
def test_bad_inputs_raise_value_error(make_input, fragment):
    logits, target = make_input()
    with pytest.raises(ValueError, match=fragment):
        vocab_parallel_cross_entropy(logits, target)


def test_label_smoothing_out_of_range():
    with pytest.raises(ValueError, match="label_smoothing must lie in \\[0, 1\\), got 1.5"):
        vocab_parallel_cross_entropy(torch.randn(2, 4), torch.zeros(2, dtype=torch.long), label_smoothing=1.5)
