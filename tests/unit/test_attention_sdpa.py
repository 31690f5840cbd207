"""Core attention's two paths: causal without an explicit mask runs PyTorch's SDPA (on CPU only without attention
dropout), an explicit mask runs the fused masked softmax. Same numbers (fp32), dropout included: SDPA draws its
dropout mask inside the RNG tracker's fork (the CUDA path, run here on CPU through ``DotProductAttention.sdpa``),
so it equals the softmax path's mask, repeats from the same tracker state and replays under recompute."""
import pytest
import torch

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


def _sdpa(attention):
    """The module's SDPA call on ``[s, b, heads, d]`` inputs, with its dropout (what CUDA runs)."""
    def run(q, k, v, mask):
        assert mask is None
        out = attention.sdpa(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), dropout_p=attention.attention_dropout)
        return out.permute(2, 0, 1, 3).reshape(SEQ, BATCH, HEADS * DIM)
    run.parallel_state = attention.parallel_state
    return run


def _run(function, mask, *, recompute=False, seed=11):
    """Output and q/k/v grads from a freshly seeded tracker (the default generator is seeded too)."""
    tracker = model_parallel_seed(seed, tp_rank=0, tracker=function.parallel_state.rng_tracker)
    q, k, v = _inputs()
    out = checkpoint(function, q, k, v, mask, rng_tracker=tracker) if recompute else function(q, k, v, mask)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), [t.grad for t in (q, k, v)]


def _used(attention) -> str:
    """The implementation the module's last forward ran (its layout's kernel backend records it)."""
    return attention.parallel_state.kernel_backend.last["attention"]


def _assert_same(got, want, tol=dict(rtol=1e-5, atol=1e-6)):
    torch.testing.assert_close(got[0], want[0], **tol)
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, **tol)


def test_causal_attention_without_mask_runs_sdpa_and_matches_the_softmax_path():
    attention = _attention(0.0)
    sdpa = _run(attention, None)
    assert _used(attention) == "sdpa"
    softmax = _run(attention, CAUSAL)
    assert _used(attention) == "softmax"
    _assert_same(sdpa, softmax)


def test_attention_dropout_uses_sdpa_on_cuda_and_the_softmax_path_on_cpu():
    attention = _attention(0.3)
    _run(attention, None)
    assert _used(attention) == "softmax"  # CPU SDPA dropout: unfused fp32 math, more memory
    choose = DotProductAttention.implementation
    assert choose(None, SEQ, SEQ, device=torch.device("cuda"), dropout_p=0.3) == "sdpa"
    assert choose(CAUSAL, SEQ, SEQ, device=torch.device("cuda"), dropout_p=0.0) == "softmax"


@pytest.mark.parametrize("recompute", [False, True])
def test_sdpa_dropout_draws_the_tracker_mask(recompute):
    attention = _attention(0.3)
    sdpa = _run(_sdpa(attention), None, recompute=recompute)
    _assert_same(sdpa, _run(attention, CAUSAL))  # same mask as F.dropout of the softmax path, in the tracker
    assert torch.equal(sdpa[0], _run(_sdpa(attention), None)[0])
    assert not torch.allclose(sdpa[0], _run(_sdpa(attention), None, seed=12)[0])  # another seed, another mask
    assert not torch.allclose(sdpa[0], _run(_attention(0.0), None)[0])  # dropout acted
