"""Core attention's two paths: causal without an explicit mask runs PyTorch's SDPA, an explicit mask runs the
fused masked softmax. Same numbers (fp32), dropout included: SDPA draws its dropout mask inside the RNG
tracker's fork, so it equals the softmax path's mask, repeats from the same tracker state and replays under
activation recompute."""
import pytest
import torch

import kernels
from megatron_core import initialize_model_parallel
from megatron_core.tensor_parallel import checkpoint, model_parallel_seed
from megatron_core.transformer import DotProductAttention
from tests.model_helpers import tiny_config

SEQ, BATCH, HEADS, DIM = 12, 2, 4, 8
CAUSAL = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)  # True = masked


def _inputs():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(SEQ, BATCH, HEADS, DIM, generator=g, requires_grad=True) for _ in range(3)]


def _attention(dropout: float) -> DotProductAttention:
    config = tiny_config(hidden_size=HEADS * DIM, num_attention_heads=HEADS, attention_dropout=dropout)
    return DotProductAttention(config, layer_number=1, parallel_state=initialize_model_parallel()).train()


def _run(attention, mask, *, recompute=False, seed=11):
    """Output and q/k/v grads from a freshly seeded tracker (the default generator is seeded too)."""
    tracker = model_parallel_seed(seed, tp_rank=0)
    q, k, v = _inputs()
    with kernels.use_backend("torch"):
        if recompute:
            out = checkpoint(attention, q, k, v, mask, rng_tracker=tracker)
        else:
            out = attention(q, k, v, mask)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), [t.grad for t in (q, k, v)]


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_sdpa_matches_the_masked_softmax_path(dropout):
    attention = _attention(dropout)
    sdpa = _run(attention, None)
    assert kernels.last_backend("attention") == "sdpa"
    softmax = _run(attention, CAUSAL)
    assert kernels.last_backend("attention") == "softmax"
    torch.testing.assert_close(sdpa[0], softmax[0], rtol=1e-5, atol=1e-6)
    for got, want in zip(sdpa[1], softmax[1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_sdpa_dropout_reproducible_from_the_tracker_and_replayed_by_recompute():
    attention = _attention(0.3)
    first, again, other = _run(attention, None), _run(attention, None), _run(attention, None, seed=12)
    assert torch.equal(first[0], again[0])
    assert not torch.allclose(first[0], other[0])  # another tracker seed draws another mask
    assert not torch.allclose(first[0], _run(_attention(0.0), None)[0])  # dropout acted
    recomputed = _run(attention, None, recompute=True)
    torch.testing.assert_close(recomputed[0], first[0], rtol=0, atol=0)
    for got, want in zip(recomputed[1], first[1]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
