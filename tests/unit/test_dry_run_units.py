"""The CPU-side pieces of the dry run, and CPU tests for the bugs it found in CUDA paths."""
import dataclasses
import importlib.util
import pathlib

import pytest
import torch

from megatron_core import initialize_model_parallel
from megatron_core.config import TransformerConfig
from megatron_core.distributed.param_and_grad_buffer import _same_memory
from megatron_core.planning.activations import ActivationShape, layer_activation_bytes
from megatron_core.transformer.attention import SelfAttention
from megatron_core.transformer.rope import RotaryEmbedding, _rotate_half, apply_rotary_pos_emb
from megatron_core.utils import accelerator
from megatron_core.utils.live_memory import LiveMemoryTracker

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _dry_run_tool():
    spec = importlib.util.spec_from_file_location("dry_run_tool", ROOT / "tools" / "dry_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rotary_embedding_follows_the_positions_device():
    """The dry run's first CUDA bug: inv_freq stayed on the host, so CUDA positions x CPU inv_freq raised.
    Meta positions stand in for another device here (before the fix: 'Expected all tensors ... same device')."""
    rope = RotaryEmbedding(16)
    out = rope(torch.arange(8).unsqueeze(0).to("meta"))
    assert out.device.type == "meta" and out.shape == (8, 1, 1, 16)


def test_same_memory_without_data_ptr():
    buffer = torch.zeros(8)
    assert _same_memory(buffer[2:], buffer[2:]) and not _same_memory(buffer[2:], buffer[3:])
    assert not _same_memory(buffer, torch.zeros(8))


def test_accelerator_answers_for_the_simulated_gpu(monkeypatch):
    monkeypatch.setenv(accelerator.FAKE_CUDA_ENV, "sm_90")
    assert accelerator.cuda_available() and accelerator.device_capability() == (9, 0)
    assert "H100" in accelerator.device_name() and accelerator.multi_processor_count() == 132
    assert accelerator.max_memory_allocated() is None and accelerator.get_rng_state().numel() == 16
    assert accelerator.is_device_backend("fake") and accelerator.is_device_backend("nccl")
    assert not accelerator.is_device_backend("gloo")
    monkeypatch.setenv(accelerator.FAKE_CUDA_ENV, "sm_42")
    with pytest.raises(ValueError, match="sm_42.*sm_90"):
        accelerator.simulated_gpu()
    monkeypatch.delenv(accelerator.FAKE_CUDA_ENV)
    assert not accelerator.is_dry_run() and accelerator.cuda_available() == torch.cuda.is_available()


def test_resolve_ranks():
    tool = _dry_run_tool()
    assert tool.resolve_ranks("first-last", 128, 4) == [0, 127]
    assert tool.resolve_ranks("all-stages", 128, 4) == [0, 32, 64, 96, 127]
    assert tool.resolve_ranks("5,1,5", 8, 1) == [1, 5]
    with pytest.raises(ValueError, match="outside the world"):
        tool.resolve_ranks("8", 8, 1)
    with pytest.raises(ValueError, match="comma-separated"):
        tool.resolve_ranks("last", 8, 1)


def test_tracker_sampling_on_allocations_finds_the_same_peaks():
    """every_op=False (the dry run's) skips scans that cannot raise the peak: same peak as every op."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64) for _ in range(6)]
    x = torch.randn(32, 64, requires_grad=True)

    def step():
        for tensor in [x] + [p for layer in layers for p in layer.parameters()]:
            tensor.grad = None
        h = x
        for layer in layers:
            h = torch.relu(layer(h)) * 2
        h.square().sum().backward()

    peaks = []
    for every_op in (True, False):
        with LiveMemoryTracker(every_op=every_op) as tracker:
            step()
        peaks.append((tracker.peak_total, tracker.peak_breakdown))
    assert peaks[0] == peaks[1] and peaks[0][0] > 6 * 32 * 64 * 4


def test_tracker_sampling_on_allocations_finds_each_categorys_peak():
    """A category tensor is named in Python after the op that made it returns (``bucket.grad_data = torch.empty
    (...)``, autograd's ``param.grad``), so the sample after that op counts it as an activation. every_op=False
    also samples after an op writes into a storage the last sampling op created, or into a category's storage:
    the grad hook's copy of ``param.grad`` into the fresh ZeRO bucket is seen with both, as every op sees it (the
    dry run's ZeRO-3 grad buckets read 524544 bytes where every op read 786432, before)."""
    named = {}

    def categories():
        return [("grad_buckets", tensor) for tensor in named.values()]

    def add_grad():
        named["grad"] = torch.ones(1000)  # the param's grad, from its backward op
        named["bucket"] = torch.empty(4000)  # the transient full bucket
        named["bucket"][1000:].zero_()  # its padding
        named["bucket"][:1000].copy_(named.pop("grad"))  # the grad in, then freed
        torch.zeros(1)  # the next op that creates a storage

    peaks = []
    for every_op in (True, False):
        named.clear()
        with LiveMemoryTracker(categories=categories, every_op=every_op) as tracker:
            add_grad()
        peaks.append((dict(tracker.peak_by_category), tracker.peak_total))
    assert peaks[0] == peaks[1] and peaks[0][0]["grad_buckets"] == 5000 * 4


def _saved_storages(fn) -> list[torch.Tensor]:
    """The distinct storages autograd saves while ``fn()`` runs (one tensor each)."""
    saved = {}

    def pack(tensor):
        saved.setdefault(tensor.untyped_storage().data_ptr(), tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return list(saved.values())


def test_rotary_embedding_saves_only_its_angles():
    """Found by the dry run's census of saved tensors: autograd saved rope's fp32 cos and sin for q and for k in
    every layer (17 MB a layer at Llama-3-70B); ``_Rotary`` saves the angles every layer shares, and its
    backward equals autograd's through the plain formula."""
    angles = RotaryEmbedding(8)(torch.arange(6).unsqueeze(0))  # [s, b, 1, d]
    x = torch.randn(6, 1, 3, 12, dtype=torch.bfloat16, requires_grad=True)
    saved = _saved_storages(lambda: apply_rotary_pos_emb(x, angles, mscale=1.3))
    assert [t.untyped_storage().data_ptr() for t in saved] == [angles.untyped_storage().data_ptr()]
    grad = torch.randn(6, 1, 3, 12, dtype=torch.bfloat16)
    got = torch.autograd.grad(apply_rotary_pos_emb(x, angles, mscale=1.3), x, grad)[0]
    x32, cos, sin = x[..., :8].float(), angles.cos() * 1.3, angles.sin() * 1.3
    reference = torch.cat([(x32 * cos + _rotate_half(x32) * sin).to(x.dtype), x[..., 8:]], dim=-1)
    torch.testing.assert_close(got, torch.autograd.grad(reference, x, grad)[0], rtol=0, atol=0)


def test_attention_does_not_save_the_qkv_output_through_v():
    """v is a view of the fused QKV output: saved as such (by SDPA, or by the selective-recompute checkpoint) it
    kept the whole ``[s, b, (heads + 2 groups) d]`` tensor alive, 19 MB a layer at 70B instead of v's 2 MB.
    With rope (q and k are copies), v is saved on its own."""
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, position_embedding_type="rope", bf16=False)
    layer = SelfAttention(config, layer_number=1, parallel_state=initialize_model_parallel())
    hidden = torch.randn(16, 2, 64, requires_grad=True)
    angles = RotaryEmbedding(16)(torch.arange(16).unsqueeze(0))
    saved = _saved_storages(lambda: layer(hidden, rotary_pos_emb=angles))
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    activations = [t.untyped_storage().nbytes() for t in saved if t.untyped_storage().data_ptr() not in weights]
    assert max(activations) == 16 * 2 * 64 * 4 < 16 * 2 * 3 * 64 * 4  # q, k, v, output: [s, b, 64]; not qkv


def test_planner_counts_fused_attention_on_cuda():
    """On CUDA (1-byte masks) core attention runs SDPA: no ``[s, s]`` softmax is saved but k and v repeated to
    every head and the output's fp32 log-sum-exp (the dry run measured the softmax model 1.9x high at Mixtral
    without recompute); the output itself is the projection's input, counted with or without recompute (a view:
    ``test_sdpa_output_is_the_projection_input``). The CPU with attention dropout keeps the softmax path and
    its terms."""
    config = TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                               ffn_hidden_size=512, attention_dropout=0.1, max_position_embeddings=1024)
    s, b, t, e, a, q, kv = 1024, 1, 2, 2, 8, 256, 64
    cuda = ActivationShape(seq_length=s, micro_batch_size=b, tp=t, sequence_parallel=True, mask_bytes=1)
    core = layer_activation_bytes(config, cuda) - layer_activation_bytes(config, cuda, selective=True)
    assert core == (e * s * b * 2 * (q - kv) + 4 * a * s * b) / t
    cpu = dataclasses.replace(cuda, mask_bytes=2)
    core = layer_activation_bytes(config, cpu) - layer_activation_bytes(config, cpu, selective=True)
    assert core == a * s * s * b * (e + 2 + e) / t  # softmax, its dropout mask and output


def test_sdpa_output_is_the_projection_input():
    """SDPA lays its output out ``[b, s, heads, d]`` (on CUDA as on the CPU), so attention's ``[s, b, heads d]``
    context is a view of what SDPA saves for backward: one tensor, which the planner counts once (as the
    projection's input). Found by the quickstart's census: counting it twice put stage 0 at 0.97."""
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, bf16=False,
                               position_embedding_type="rope")
    layer = SelfAttention(config, layer_number=1, parallel_state=initialize_model_parallel())
    query, key, value = (torch.randn(16, 2, 4, 16, requires_grad=True) for _ in range(3))
    context = []
    saved = _saved_storages(lambda: context.append(layer.core_attention(query, key, value)))
    assert layer.core_attention.implementation(None, 16, 16, device=query.device, dropout_p=0.0) == "sdpa"
    assert context[0].shape == (16, 2, 64)
    assert context[0].untyped_storage().data_ptr() in {t.untyped_storage().data_ptr() for t in saved}


def test_dry_run_runs_silu_backward_as_one_kernel(monkeypatch):
    """A GPU runs SwiGLU's ``silu_backward`` as one fused kernel; fake mode ran ``torch._decomp``'s decomposition
    (sigmoid, ones, sub, mul, add, mul, mul), whose temporaries put the 8B dry run's first stage at 1.08 of the
    planner. The dry run now answers it with one output and never calls the decomposition."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_core.dryrun.modes import FakeCudaMode
    seen = []
    dispatch = FakeTensorMode.__torch_dispatch__

    def recording(self, func, types, args=(), kwargs=None):
        seen.append(func.__name__)
        return dispatch(self, func, types, args, kwargs)
    monkeypatch.setattr(FakeTensorMode, "__torch_dispatch__", recording)
    with FakeCudaMode():
        grad, x = (torch.empty(4, 8, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        seen.clear()
        out = torch.ops.aten.silu_backward.default(grad, x)
        assert out.device.type == "cuda" and out.shape == (4, 8) and out.dtype == torch.bfloat16
    assert not any(name.startswith(("sigmoid", "mul", "sub", "add")) for name in seen), seen


def test_context_parallel_dropout_mask_in_a_dry_run(monkeypatch):
    """Found by the dry run of a cp layout: the ring's dropout tiles made a CUDA ``torch.Generator``, which a CPU
    build cannot ('Cannot get CUDA generator without ATen_cuda library'); a dry run draws without one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_core.context_parallel.blocks import tile_keep_mask
    monkeypatch.setenv(accelerator.FAKE_CUDA_ENV, "sm_90")
    with FakeTensorMode():
        keep = tile_keep_mask((2, 4, 8), p=0.1, seed=3, first_row=0, device=torch.device("cuda"))
    assert keep.shape == (2, 4, 8) and keep.dtype == torch.bool and keep.device.type == "cuda"
    monkeypatch.delenv(accelerator.FAKE_CUDA_ENV)
    first = tile_keep_mask((2, 4, 8), p=0.5, seed=3, first_row=0, device=torch.device("cpu"))
    assert torch.equal(first, tile_keep_mask((2, 4, 8), p=0.5, seed=3, first_row=0, device=torch.device("cpu")))


def test_fast_tracker_samples_a_fraction_and_finds_the_same_peaks():
    """The fast mode samples after an op that created a storage only when the last sample's bytes plus
    everything created since could exceed the peak (or the activations alone theirs). Over an MLP's forward,
    backward and Adam step it finds the total peak, its split and every category's peak that a sample after
    every op finds, with under half its samples (91 of 202; before, every creation was sampled: 144)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(6)])
    optimizer = torch.optim.Adam(model.parameters())

    def categories():
        yield from (("parameters", p) for p in model.parameters())
        yield from (("gradients", p.grad) for p in model.parameters() if p.grad is not None)
        yield from (("optimizer_states", v) for state in optimizer.state.values() for k, v in state.items()
                    if k != "step")

    def step():
        model(torch.randn(32, 64)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # the optimizer states exist from here on, as in the banner's second step
    every_op, fast = LiveMemoryTracker(categories=categories), LiveMemoryTracker(categories=categories, every_op=False)
    with every_op, fast:
        step()
    assert fast.peak_total == every_op.peak_total > 0 and fast.peak_breakdown == every_op.peak_breakdown
    assert dict(fast.peak_by_category) == dict(every_op.peak_by_category)
    assert fast.samples < every_op.samples / 2, (fast.samples, every_op.samples)


def test_fast_tracker_samples_after_a_write_into_a_category_storage_that_grew():
    """A freed buffer given its memory back in Python (``allocate_storage`` before ZeRO-3's copy at dp 1 or an
    offload fetch) grows without an op that creates a storage: the fast tracker samples after the write into
    it, and finds the peak it makes (28000 bytes) as a sample after every op does."""
    from megatron_core.distributed.param_and_grad_buffer import allocate_storage, free_storage
    buffer, source = torch.empty(4000), torch.ones(4000)
    peaks = []
    for every_op in (True, False):
        allocate_storage(buffer)
        with LiveMemoryTracker(categories=lambda: [("gathered_parameters", buffer)], every_op=every_op) as tracker:
            buffer.zero_()  # counted: 16000 bytes
            free_storage(buffer)
            kept = torch.ones(3000)  # 12000 bytes, sampled with the buffer freed
            allocate_storage(buffer)
            buffer.copy_(source)  # 16000 + 12000
            del kept
        peaks.append(tracker.peak_total)
    assert peaks == [28000, 28000]
