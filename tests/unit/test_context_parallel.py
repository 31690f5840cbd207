"""The load-balanced causal split and the blockwise attention math of context parallelism, in one process:
positions per rank, the order permutations, balanced causal work, the log-sum-exp merge and the block
backward against autograd of plain attention (causal, GQA, masks, dropout)."""
import math

import pytest
import torch

from megatron_core.context_parallel import (
    check_sequence_split,
    local_positions,
    split_batch,
    split_sequence,
    to_natural_order,
    to_rank_chunk_order,
)
from megatron_core.context_parallel.blocks import block_backward, block_forward, merge_, tile_keep_mask


def test_rank_r_holds_chunks_r_and_2cp_minus_1_minus_r():
    assert local_positions(16, cp_size=2, cp_rank=0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_positions(16, cp_size=2, cp_rank=1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert local_positions(16, cp_size=4, cp_rank=3).tolist() == [6, 7, 8, 9]


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_split_then_gather_in_rank_order_is_the_natural_order(cp):
    x = torch.arange(2 * 32 * 3).view(2, 32, 3)
    pieces = [split_sequence(x, dim=1, cp_size=cp, cp_rank=r) for r in range(cp)]
    gathered = torch.cat(pieces, dim=1)
    assert torch.equal(to_natural_order(gathered, dim=1, cp_size=cp), x)
    assert torch.equal(to_rank_chunk_order(x, dim=1, cp_size=cp), gathered)
    batch = split_batch({"position_ids": torch.arange(32).expand(2, 32)}, cp_size=cp, cp_rank=cp - 1)
    assert batch["position_ids"][0].tolist() == local_positions(32, cp_size=cp, cp_rank=cp - 1).tolist()


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_every_rank_does_the_same_causal_work(cp):
    work = [int((local_positions(64, cp_size=cp, cp_rank=r) + 1).sum()) for r in range(cp)]
    assert len(set(work)) == 1


def test_sequence_not_divisible_names_the_values():
    with pytest.raises(ValueError, match=r"sequence length 30 is not divisible by 2 x context_parallel_size 4 = 8"):
        check_sequence_split(30, 4)
    with pytest.raises(ValueError, match="not divisible"):
        split_sequence(torch.zeros(2, 30), dim=1, cp_size=4, cp_rank=0)


def _attention(q, k, v, mask, scale, keep=None, p=0.0):
    """Plain attention with autograd: q [b, hq, sq, d], k/v [b, hk, sk, d], mask True = masked."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    if keep is not None:
        probs = probs * keep / (1 - p)
    return probs @ v


def _inputs(sq=6, sk=6, hq=4, hk=2, d=3, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, h, s, d, generator=g, dtype=dtype) for h, s in ((hq, sq), (hk, sk), (hk, sk))]


def test_merging_two_key_blocks_equals_one_softmax():
    q, k, v = _inputs(sk=10)
    mask = torch.zeros(1, 1, 6, 10, dtype=torch.bool)
    mask[..., 0, :6] = True  # query row 0 sees nothing in the first block
    mask[..., 1, :] = True   # query row 1 sees nothing at all
    expected = _attention(q, k, v, mask, 0.5)
    out, lse = block_forward(q, k[:, :, :6], v[:, :, :6], scale=0.5, causal=False, mask=mask[..., :6])
    other, other_lse = block_forward(q, k[:, :, 6:], v[:, :, 6:], scale=0.5, causal=False, mask=mask[..., 6:])
    merge_(out, lse, other, other_lse)
    torch.testing.assert_close(out, expected)
    assert torch.isinf(lse[0, 0, 1]) and not torch.isnan(out).any()


@pytest.mark.parametrize("dropout, tile_elements", [(0.0, 1 << 20), (0.3, 1 << 20), (0.0, 30)],
                         ids=["one-tile", "one-tile-dropout", "tiles-of-1-row"])
def test_block_backward_equals_autograd(dropout, tile_elements):
    q, k, v = (x.requires_grad_() for x in _inputs())
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    mask = torch.zeros(1, 1, 6, 6, dtype=torch.bool)
    mask[..., 4] = True  # a padded key
    keep = tile_keep_mask((1, 4, 6, 6), p=dropout, seed=3, first_row=0, device=q.device) if dropout else None
    scale = 1 / math.sqrt(3)
    expected = _attention(q, k, v, mask | causal, scale, keep, dropout)
    dout = torch.randn_like(expected)
    expected.backward(dout)
    common = dict(scale=scale, causal=True, mask=mask, dropout_p=dropout, dropout_seed=3, tile_elements=tile_elements)
    out, lse = block_forward(q.detach(), k.detach(), v.detach(), **common)
    torch.testing.assert_close(out, expected.detach())
    grads = block_backward(q.detach(), k.detach(), v.detach(), dout, delta=(dout * out).sum(-1), lse=lse, **common)
    for grad, tensor in zip(grads, (q, k, v)):
        torch.testing.assert_close(grad, tensor.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal,offset,sq,sk", [(False, 0, 8, 16), (True, 0, 16, 16), (True, 8, 8, 16),
                                                 (True, 4, 8, 32)])
def test_fused_block_equals_tiled_math(monkeypatch, dtype, causal, offset, sq, sk):
    """The fused CPU flash kernels (log-sum-exp out, final statistics in) give the tiled math's block
    output, statistics and grads, GQA and causal offsets included (the offset cuts the block in two)."""
    from megatron_core.context_parallel import blocks

    generator = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(2, 4, sq, 8, generator=generator, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(2, 2, sk, 8, generator=generator, dtype=dtype) for _ in range(2))
    results = []
    for fused in (True, False):
        monkeypatch.setattr(blocks, "FUSED", fused)
        assert blocks.fused_ok(q, mask=None, dropout_p=0.0, dropout_seed=None) is fused
        out, lse = block_forward(q, k, v, scale=0.3, causal=causal, causal_offset=offset)
        grads = block_backward(q, k, v, dout, delta=(dout * out).sum(-1), lse=lse, scale=0.3, causal=causal,
                               causal_offset=offset, out=out.to(dtype))
        results.append((out, lse, *grads))
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    for fused, tiled in zip(*results):
        torch.testing.assert_close(fused, tiled, rtol=tolerance, atol=tolerance)


def test_masks_and_dropout_keep_the_tiled_math():
    from megatron_core.context_parallel.blocks import fused_ok

    q = torch.zeros(1, 1, 4, 2)
    assert not fused_ok(q, mask=torch.zeros(1, 1, 4, 4, dtype=torch.bool), dropout_p=0.0, dropout_seed=None)
    assert not fused_ok(q, mask=None, dropout_p=0.1, dropout_seed=3)
    assert fused_ok(q, mask=None, dropout_p=0.1, dropout_seed=None)


@pytest.mark.parametrize("kernel", ["cuda_flash", "cuda_efficient"])
def test_cuda_kernel_calls_match_the_operator_schemas(kernel):
    """The CUDA kernels' calls parse against torch's operator schemas: on CPU tensors the dispatcher gets as
    far as "no CPU kernel" (a wrong argument would fail earlier, with a different error). The CUDA kernels
    themselves are not run here (no GPU)."""
    from megatron_core.context_parallel import fused

    q = torch.zeros(1, 2, 8, 16)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(NotImplementedError, match="CPU' backend"):
        fused.piece_forward(kernel, q, q, q, scale=0.25, causal=True)
    with pytest.raises(NotImplementedError, match="CPU' backend"):
        fused.piece_backward(kernel, q, q, q, q, q, lse, scale=0.25, causal=True)


class _CudaConventionsOnCpu:
    """Stand-ins for the CUDA SDPA operators with their return conventions (extra outputs; the efficient
    kernel's statistics padded to 32 rows, nan in the padding), computed by the CPU flash kernel."""

    cpu, cpu_backward = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                         torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)

    def _scaled_dot_product_flash_attention(self, q, k, v, p, causal, debug, *, scale):
        out, lse = self.cpu(q, k, v, p, causal, scale=scale)
        return out, lse, None, None, q.shape[2], k.shape[2], torch.zeros(2), torch.zeros(0), torch.zeros(0)

    def _scaled_dot_product_flash_attention_backward(self, dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, p,
                                                     causal, seed, offset, *, scale):
        assert (max_q, max_k, cum_q, cum_k) == (q.shape[2], k.shape[2], None, None)
        return self.cpu_backward(dout, q, k, v, out, lse, p, causal, scale=scale)

    def _scaled_dot_product_efficient_attention(self, q, k, v, bias, compute_lse, p, causal, *, scale):
        assert bias is None and compute_lse
        out, lse = self.cpu(q, k, v, p, causal, scale=scale)
        padded = torch.full((*lse.shape[:-1], -(-lse.shape[-1] // 32) * 32), float("nan"))
        padded[..., : lse.shape[-1]] = lse
        return out, padded, torch.zeros(()), torch.zeros(())

    def _scaled_dot_product_efficient_attention_backward(self, dout, q, k, v, bias, out, lse, seed, offset, p, mask,
                                                         causal, *, scale):
        assert lse.shape[-1] % 32 == 0 and lse.is_contiguous() and list(mask) == [True, True, True, False]
        return (*self.cpu_backward(dout, q, k, v, out, lse[..., : q.shape[2]].contiguous(), p, causal, scale=scale),
                None)


@pytest.mark.parametrize("kernel", ["cuda_flash", "cuda_efficient"])
@pytest.mark.parametrize("causal,offset,sq,sk", [(False, 0, 8, 16), (True, 0, 16, 16), (True, 8, 8, 16)])
def test_cuda_block_glue_equals_tiled_math(monkeypatch, kernel, causal, offset, sq, sk):
    """The shared piece / merge logic and the CUDA kernels' glue (argument order, the efficient kernel's
    padded statistics) give the tiled math's block output, statistics and grads, with CPU stand-ins for the
    CUDA operators (``_CudaConventionsOnCpu``); GQA and a causal offset (two merged pieces) included."""
    from megatron_core.context_parallel import blocks, fused

    monkeypatch.setattr(fused, "_ATEN", _CudaConventionsOnCpu())
    generator = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(2, 4, sq, 8, generator=generator) for _ in range(2))
    k, v = (torch.randn(2, 2, sk, 8, generator=generator) for _ in range(2))
    results = []
    for fused_kernel in (kernel, None):
        monkeypatch.setattr(fused, "kernel_for", lambda _q, name=fused_kernel: name)
        out, lse = block_forward(q, k, v, scale=0.3, causal=causal, causal_offset=offset)
        grads = block_backward(q, k, v, dout, delta=(dout * out).sum(-1), lse=lse, scale=0.3, causal=causal,
                               causal_offset=offset, out=out)
        results.append((out, lse, *grads))
    assert blocks.fused_ok(q, mask=None, dropout_p=0.0, dropout_seed=None) is False  # the last kernel_for: None
    for fused_result, tiled in zip(*results):
        torch.testing.assert_close(fused_result, tiled, rtol=1e-5, atol=1e-5)
