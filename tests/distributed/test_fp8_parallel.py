"""FP8 training across layouts: a tiny GPTModel at tp 2 with sequence parallelism equals tp 1 (tensorwise, and
delayed over 3 steps with the per-step ``update_fp8_scales``): loss, every gathered grad and the scaling state;
dp 2 (each rank half the micro-batches) equals one process seeing them all under delayed scaling; the MoE layer
at ep 2 in FP8 (delayed, loop and grouped GEMM) equals the single-process layer over 3 steps."""
import pytest
import torch
import torch.distributed as dist

from tests.model_helpers import build_model, full_grads, make_batch, tiny_config

LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
BASE = dict(num_query_groups=4, num_attention_heads=8, position_embedding_type="rope", activation="swiglu",
            normalization="RMSNorm")
MLA = dict(multi_latent_attention=True, q_lora_rank=12, kv_lora_rank=8, qk_head_dim=4, qk_pos_emb_head_dim=4,
           v_head_dim=6, normalization="RMSNorm", qk_layernorm=True, position_embedding_type="rope",
           add_bias_linear=False, rotary_interleaved=True)  # tests/unit/test_mla.py's MLA_GPT, without YaRN
TP_CASES = {
    "gqa-sp": {**BASE, "sequence_parallel": True},
    "gqa-sp-overlap": {**BASE, "sequence_parallel": True, "tp_comm_overlap": True},
    "mla-sp": {**MLA, "sequence_parallel": True},  # the replicated down projections see half the tokens
}
RECIPES = {
    "tensorwise": dict(fp8_recipe="tensorwise"),
    "delayed": dict(fp8_recipe="delayed", fp8_amax_history_len=2, fp8_amax_compute_algo="max", fp8_margin=1),
}


def _grads(model):
    return {name: (p.grad.clone(), p.partition_dim if p.tensor_model_parallel else None, p.partition_stride)
            for name, p in model.named_parameters()}


def _sgd(model, lr=0.1):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-lr)
            p.grad = None


def _scales(model):
    from megatron_core.fp8.state import scaling_states
    return [state.fp8_scale.clone() for state in scaling_states([model])]


def _tp_steps(tp, recipe, overrides, steps=3):
    """``steps`` training steps at tp (this process's world size, or 1): per step (loss, grads); the scales."""
    from megatron_core import initialize_model_parallel
    from megatron_core.distributed import finalize_model_grads
    from megatron_core.fp8 import Fp8Config, update_fp8_scales
    from megatron_core.transformer.moe import moe_layer_spec
    state = initialize_model_parallel(tensor_model_parallel_size=tp)  # ep 1, etp 1
    config = tiny_config(tensor_model_parallel_size=tp, fp8=Fp8Config(**RECIPES[recipe]), **overrides)
    model = build_model(config, state, **({"layer_spec": moe_layer_spec()} if "moe" in overrides else {}))
    results = []
    for step in range(steps):
        input_ids, positions, labels = make_batch(seed=step)
        loss = model(input_ids, positions, labels=labels)
        loss.mean().backward()
        finalize_model_grads(model, state)
        if tp > 1 and "moe" in overrides:  # whole experts on every tp rank, each its own tokens (DDP's expert-dp sum)
            for name, p in model.named_parameters():
                if ".local_experts." in name:
                    dist.all_reduce(p.grad, group=state.expert_dp_group)
        results.append((loss.detach(), _grads(model)))
        _sgd(model)
        update_fp8_scales([model], state)
    return results, _scales(model)


@pytest.mark.parametrize("case", list(TP_CASES))
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_tp2_sequence_parallel_matches_tp1(distributed, recipe, case):
    steps = 3 if recipe == "delayed" else 1
    overrides = {k: v for k, v in TP_CASES[case].items() if k not in ("sequence_parallel", "tp_comm_overlap")}
    reference, ref_scales = _tp_steps(1, recipe, overrides, steps)
    per_rank = distributed(2, _tp_steps, 2, recipe, TP_CASES[case], steps)
    for step in range(steps):
        ref_loss, ref_grads = reference[step]
        gathered = full_grads([results[step][1] for results, _ in per_rank])
        for results, _ in per_rank:
            torch.testing.assert_close(results[step][0], ref_loss, **LOSS_TOL)
        assert gathered.keys() == ref_grads.keys()
        for name, grad in gathered.items():
            torch.testing.assert_close(grad, ref_grads[name][0], **GRAD_TOL,
                                       msg=lambda m: f"{recipe} {case} step {step} grad {name}: {m}")
    for _, scales in per_rank:  # the delayed state is replicated over tp and equals tp 1's
        for mine, ref in zip(scales, ref_scales):
            torch.testing.assert_close(mine, ref, rtol=1e-6, atol=0)
    if recipe == "delayed":
        assert any((s != 1).any() for s in ref_scales)


@pytest.mark.parametrize("grouped", [False, True])
def test_moe_tp2_etp1_delayed_matches_tp1(distributed, grouped):
    """MoE layers at tp 2 with SP and whole experts (ep 1, etp 1: expert tp != tp): each rank routes its half of
    the tokens through every expert; delayed scaling's amaxes, reduced over tp at the update, give tp 1's scales,
    so losses, grads and scales equal the single-process FP8 run (tensorwise current scaling would quantize each
    rank's tokens with their own amax: not layout-invariant, docs/fp8.md)."""
    from megatron_core.transformer.moe import MoEConfig
    moe = MoEConfig(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                    moe_grouped_gemm=grouped)
    reference, ref_scales = _tp_steps(1, "delayed", {**BASE, "moe": moe})
    per_rank = distributed(2, _tp_steps, 2, "delayed", {**BASE, "moe": moe, "sequence_parallel": True})
    for step, (ref_loss, ref_grads) in enumerate(reference):
        gathered = full_grads([results[step][1] for results, _ in per_rank])
        for results, _ in per_rank:
            torch.testing.assert_close(results[step][0], ref_loss, **LOSS_TOL)
        for name, grad in gathered.items():
            torch.testing.assert_close(grad, ref_grads[name][0], **GRAD_TOL, msg=lambda m: f"step {step} {name}: {m}")
    for _, scales in per_rank:
        for mine, ref in zip(scales, ref_scales):
            torch.testing.assert_close(mine, ref, rtol=1e-6, atol=0)
    experts = [s for s in ref_scales if s.dim() == 3]  # [E, 2, 3] tables: every expert calibrated
    assert experts and all((s > 0).all() for s in experts)


MICRO_BATCHES = 4


def _dp_steps(steps=3):
    """Delayed FP8 over ``steps``: each of this process's dp ranks runs every dp-th of MICRO_BATCHES micro-batches;
    grads summed over dp. Per step: the summed grads and loss; at the end the scales."""
    from megatron_core import initialize_model_parallel
    from megatron_core.fp8 import Fp8Config, update_fp8_scales
    state = initialize_model_parallel(tensor_model_parallel_size=1)
    config = tiny_config(fp8=Fp8Config(**RECIPES["delayed"]), **BASE)
    model = build_model(config, state)
    results = []
    for step in range(steps):
        total = torch.zeros(())
        for micro in range(state.dp_rank, MICRO_BATCHES, state.dp_size):
            input_ids, positions, labels = make_batch(seed=MICRO_BATCHES * step + micro)
            loss = model(input_ids, positions, labels=labels).mean() / MICRO_BATCHES
            loss.backward()
            total += loss.detach()
        grads = {n: p.grad for n, p in model.named_parameters()}
        if state.dp_size > 1:
            for grad in [*grads.values(), total]:
                dist.all_reduce(grad, group=state.dp_group)
        results.append((total, {n: g.clone() for n, g in grads.items()}))
        _sgd(model)
        update_fp8_scales([model], state)
    return results, _scales(model)


def test_dp2_delayed_scaling_matches_one_process(distributed):
    reference, ref_scales = _dp_steps()
    for results, scales in distributed(2, _dp_steps):
        for (loss, grads), (ref_loss, ref_grads) in zip(results, reference):
            torch.testing.assert_close(loss, ref_loss, **LOSS_TOL)
            for name, grad in grads.items():
                torch.testing.assert_close(grad, ref_grads[name], **GRAD_TOL, msg=lambda m: f"{name}: {m}")
        for mine, ref in zip(scales, ref_scales):
            torch.testing.assert_close(mine, ref, rtol=1e-6, atol=0)
    assert any((s != 1).any() for s in ref_scales)


def _ep_fp8_body(options, steps=3):
    """MoELayer at ep 2 with delayed FP8 against this rank's single-process layer (every expert, its own tokens),
    both updated after each step."""
    import dataclasses

    from megatron_core import destroy_model_parallel, initialize_model_parallel
    from megatron_core.fp8 import Fp8Config, update_fp8_scales
    from megatron_core.transformer.moe import MoELayer
    from tests.distributed.test_moe_parallel import B, H, S, _config, _run, _single, _sum_over
    state = initialize_model_parallel(expert_model_parallel_size=2)
    fp8 = Fp8Config(**RECIPES["delayed"])
    try:
        config = dataclasses.replace(_config(**options), fp8=fp8)
        torch.manual_seed(5)
        layer = MoELayer(config, layer_number=1, parallel_state=state)
        torch.manual_seed(5)
        ref = MoELayer(config, layer_number=1, parallel_state=_single(state))
        assert layer.experts.fp8 == fp8 and ref.experts.fp8_state.fp8_scale.shape == (4, 2, 3)
        gen = torch.Generator().manual_seed(100 + state.rank)
        for step in range(steps):
            x, g = torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)
            out, dx, grads, _ = _run(layer, x, g)
            ref_out, ref_dx, ref_grads, _ = _run(ref, x, g)
            torch.testing.assert_close(out, ref_out, **LOSS_TOL, msg=lambda m: f"step {step} output: {m}")
            torch.testing.assert_close(dx, ref_dx, **GRAD_TOL, msg=lambda m: f"step {step} input grad: {m}")
            summed = {n: _sum_over(v, state.ep_group) if ".local_experts." in n else v for n, v in ref_grads.items()}
            for name, grad in grads.items():
                torch.testing.assert_close(grad, summed[name], **GRAD_TOL, msg=lambda m: f"step {step} {name}: {m}")
            for module in (layer, ref):
                module.zero_grad()
                update_fp8_scales([module], state)
            torch.testing.assert_close(layer.experts.fp8_state.fp8_scale, ref.experts.fp8_state.fp8_scale,
                                       rtol=0, atol=0)
        return ref.experts.fp8_state.fp8_scale
    finally:
        destroy_model_parallel(state)


@pytest.mark.parametrize("options", [{"moe_token_dispatcher_type": "alltoall"},
                                     {"moe_token_dispatcher_type": "allgather", "moe_grouped_gemm": True}])
def test_moe_ep2_fp8_matches_single_process(distributed, options):
    tables = distributed(2, _ep_fp8_body, options)
    torch.testing.assert_close(tables[0], tables[1], rtol=0, atol=0)  # replicated over the stage
    assert (tables[0] != 1).all()  # every expert's every role saw tokens and got its scale


def _zero_steps(stage, steps=3):
    """Delayed FP8 with ``fp8_param_gather`` under DistributedDataParallel at ``zero_stage`` and the optimizer:
    MICRO_BATCHES split over dp. Per step the mean loss; at the end the scales."""
    import contextlib

    from megatron_core import initialize_model_parallel
    from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron_core.fp8 import Fp8Config, update_fp8_scales
    from megatron_core.optimizer import OptimizerConfig, get_optimizer
    state = initialize_model_parallel(tensor_model_parallel_size=1)
    fp8 = Fp8Config(**RECIPES["delayed"], fp8_param_gather=True)
    model = build_model(tiny_config(fp8=fp8, **BASE), state)
    ddp = DistributedDataParallel(model, config=DistributedDataParallelConfig(zero_stage=stage),
                                  dp_group=state.dp_group)
    # SGD: Adam's m / sqrt(v) turns the 1e-7 reduction-order differences of near-zero grads into lr-sized steps,
    # which FP8 rounding may then amplify to one-ulp flips; SGD keeps the weights within 1e-9 across layouts
    optimizer = get_optimizer(OptimizerConfig(optimizer="sgd", lr=0.1, weight_decay=0.0), ddp, parallel_state=state)
    mine = list(range(state.dp_rank, MICRO_BATCHES, state.dp_size))
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        total = torch.zeros(())
        for i, micro in enumerate(mine):
            input_ids, positions, labels = make_batch(seed=MICRO_BATCHES * step + micro)
            with ddp.no_sync() if i < len(mine) - 1 else contextlib.nullcontext():
                loss = ddp(input_ids, positions, labels=labels).mean() / len(mine)
                loss.backward()
            total += loss.detach()
        finalize_model_grads([ddp], state)
        assert optimizer.step()[0]
        update_fp8_scales([ddp], state)
        if state.dp_size > 1:
            dist.all_reduce(total, group=state.dp_group)
        losses.append(total / state.dp_size)
    return losses, _scales(model)


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_dp2_with_fp8_param_gather_matches_dp1(distributed, stage):
    """fp8_param_gather gathers the high-precision shards (the quantization runs after the gather): exact. The
    wrapper averages grads over dp, so each rank's loss (over half the micro-batches) has twice dp 1's output
    grads: their scales are exactly half, the same FP8 bytes (the first step calibrates unquantized)."""
    (ref_losses, ref_scales), = distributed(1, _zero_steps, 0)
    for losses, scales in distributed(2, _zero_steps, stage):
        torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), **LOSS_TOL)
        for mine, ref in zip(scales, ref_scales):
            torch.testing.assert_close(mine[..., :2], ref[..., :2], rtol=1e-6, atol=0)
            torch.testing.assert_close(mine[..., 2] * 2, ref[..., 2], rtol=1e-6, atol=0)
    assert ref_losses[-1] < ref_losses[0]


def _count_sent_bytes(counter, log=None):
    """Wraps ``dist.isend`` with the parameter-gather tag and ``dist.all_gather_single`` (the parameter gathers'
    transfers: p2p, or the collective; tp 1 has no other all-gather) to add the bytes each call sends to
    ``counter[0]``; with ``log``, ``Bucket.start_gather`` too, to append ``(bucket index, fp8)`` for each ZeRO-3
    gather it starts, and ``dist.all_reduce``, counted in ``log.all_reduces``. Returns the undo."""
    from megatron_core.distributed.p2p_collectives import PARAM_GATHER_TAG
    from megatron_core.distributed.param_and_grad_buffer import Bucket
    originals = dist.isend, dist.all_gather_single, Bucket.start_gather, dist.all_reduce

    def isend(tensor, *args, **kwargs):
        if kwargs.get("tag") == PARAM_GATHER_TAG:
            counter[0] += tensor.numel() * tensor.element_size()
        return originals[0](tensor, *args, **kwargs)

    def all_gather_single(output, tensor, *args, **kwargs):
        counter[0] += tensor.numel() * tensor.element_size()
        return originals[1](output, tensor, *args, **kwargs)

    def start_gather(bucket, fp8=False):
        if log is not None and not bucket.gathered and not bucket.gather_in_flight and bucket.dp_size > 1:
            log.append((bucket.index, fp8))
        return originals[2](bucket, fp8)

    def all_reduce(*args, **kwargs):
        if log is not None:
            log.all_reduces += 1
        return originals[3](*args, **kwargs)
    dist.isend, dist.all_gather_single, Bucket.start_gather, dist.all_reduce = (
        isend, all_gather_single, start_gather, all_reduce)

    def undo():
        dist.isend, dist.all_gather_single, Bucket.start_gather, dist.all_reduce = originals
    return undo


class _GatherLog(list):
    """``(bucket index, fp8)`` of the ZeRO-3 gathers started, and the number of ``dist.all_reduce`` calls."""
    all_reduces = 0


def _fp8_weights(ddp):
    return {m.weight for m in ddp.module.modules()
            if getattr(m, "fp8", None) is not None and isinstance(getattr(m, "weight", None), torch.nn.Parameter)}


def _bucket_split(bucket, weights):
    """``(elements of FP8 linears' weights, bytes of the other parameters at the parameter dtype, the shard's
    whole bytes with padding, whether the bucket holds FP8 linears' weights)`` of this rank's shard of ``bucket``."""
    fp8 = other = 0
    for param, _, _, lo, hi in bucket.shard_pieces():
        if param in weights:
            fp8 += hi - lo
        else:
            other += (hi - lo) * bucket.kind.param_dtype.itemsize
    return fp8, other, bucket.shard_size * bucket.kind.param_dtype.itemsize, any(p in weights for p in bucket.params)


def _gather_split(ddp, fp8_weights=_fp8_weights):
    """Bytes this rank's shards send per peer: ``(elements of FP8 linears' weights, bytes of the other parameters
    at the parameter dtype, the shards' whole bytes with padding, FP8 weights holding their gathered scale)``."""
    weights = fp8_weights(ddp)
    fp8, other, whole = (sum(x) for x in list(zip(*(_bucket_split(b, weights) for b in ddp.buckets)))[:3])
    copies = sum(getattr(w, "fp8_gathered", None) is not None for w in weights)
    return fp8, other, whole, (copies, len(weights))


def _build_zero(stage, recipe, param_gather, p2p, state, model=None):
    """``model``: config overrides on top of BASE (a ``moe`` one builds with the MoE layer spec)."""
    from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron_core.fp8 import Fp8Config
    from megatron_core.optimizer import OptimizerConfig, get_optimizer
    from megatron_core.transformer.moe import moe_layer_spec
    recipe = RECIPES.get(recipe, {"fp8_recipe": recipe})
    fp8, overrides = Fp8Config(**recipe, fp8_param_gather=param_gather), {**BASE, **(model or {})}
    model = build_model(tiny_config(fp8=fp8, params_dtype=torch.bfloat16, bf16=True, **overrides), state,
                        **({"layer_spec": moe_layer_spec()} if "moe" in overrides else {}))
    ddp = DistributedDataParallel(model, config=DistributedDataParallelConfig(zero_stage=stage, p2p_collectives=p2p),
                                  dp_group=state.dp_group)
    optimizer = get_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0), ddp, parallel_state=state)
    return ddp, optimizer


def _train_step(ddp, optimizer, state, step, counter):
    """One step over this rank's micro-batches; delayed scales updated before the optimizer step (so the gather
    knows the next forward's scale). Returns (loss, grad shards, masters, bytes the step's parameter gathers sent:
    after the step at ZeRO-1/2, the units' gathers in forward and backward at ZeRO-3, and the ZeRO-3 gathers
    started: ``(bucket index, fp8)`` each)."""
    import contextlib

    from megatron_core.distributed import finalize_model_grads
    from megatron_core.fp8 import update_fp8_scales
    counter[0], log = 0, _GatherLog()
    undo = _count_sent_bytes(counter, log)
    try:
        optimizer.zero_grad()
        mine = list(range(state.dp_rank, MICRO_BATCHES, state.dp_size))
        total = torch.zeros(())
        for i, micro in enumerate(mine):
            input_ids, positions, labels = make_batch(seed=MICRO_BATCHES * step + micro)
            with ddp.no_sync() if i < len(mine) - 1 else contextlib.nullcontext():
                loss = ddp(input_ids, positions, labels=labels).float().mean() / len(mine)
                loss.backward()
            total += loss.detach()
        finalize_model_grads([ddp], state)
        grads = [b.grad_shard.clone() for b in ddp.buckets]
        update_fp8_scales([ddp], state)
        assert optimizer.step()[0]
    finally:
        undo()
    masters = [p.master.clone() for p in optimizer.pieces]
    return total, grads, masters, counter[0], (list(log), log.all_reduces)


def _fp8_gather_run(stage, recipe, param_gather, p2p, steps=3, model=None, weights=_fp8_weights):
    """``steps`` steps at dp 2 (bf16 parameters, Adam, clipping); then a resume check: a fresh model and optimizer
    loading the state dicts (saved with ``ddp.state_dict()``: exact) runs one more step as the original does.
    ``model``: ``_build_zero``'s; ``weights(ddp)``: the parameters expected to go as FP8 bytes."""
    from megatron_core import initialize_model_parallel
    state = initialize_model_parallel(tensor_model_parallel_size=1)
    ddp, optimizer = _build_zero(stage, recipe, param_gather, p2p, state, model)
    counter, results = [0], []
    for step in range(steps):
        results.append(_train_step(ddp, optimizer, state, step, counter))
    import copy
    saved = ({k: v.clone() for k, v in ddp.state_dict().items()}, copy.deepcopy(optimizer.state_dict()))
    params = dict(saved[0])
    fresh, fresh_opt = _build_zero(stage, recipe, param_gather, p2p, state, model)
    fresh.load_state_dict(saved[0])
    fresh_opt.load_state_dict(saved[1])
    resumed = _train_step(fresh, fresh_opt, state, steps, counter)
    continued = _train_step(ddp, optimizer, state, steps, counter)
    expected = weights(ddp)
    buckets = {b.index: _bucket_split(b, expected) for b in ddp.buckets}
    return results, params, resumed[:3], continued[:3], _gather_split(ddp, weights), buckets


def _assert_equal(a, b, what):
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{what}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            _assert_equal(a[k], b[k], f"{what}[{k}]")
    else:
        assert torch.equal(a, b), f"{what} differs"


def _assert_same_training(rank, ref, mine):
    """The run with the flag (``mine``) equals the one without (``ref``) bit for bit: each step's loss, reduced
    grads and fp32 masters, the final (exact) parameters, the step after a resume from the state dicts."""
    (ref_steps, ref_params, ref_resumed, ref_continued, *_), (steps, params, resumed, continued, *_) = ref, mine
    _assert_equal(ref_resumed, ref_continued, f"rank {rank} resumed step without the flag")
    _assert_equal([s[:3] for s in steps], [s[:3] for s in ref_steps], f"rank {rank} steps")
    _assert_equal(params, ref_params, f"rank {rank} parameters")
    _assert_equal(resumed, continued, f"rank {rank} resumed step")
    _assert_equal(continued, ref_continued, f"rank {rank} step after the checkpoint")


@pytest.mark.parametrize("stage,recipe,p2p", [(1, "tensorwise", None), (2, "tensorwise", None),
                                              (1, "delayed", None), (2, "delayed", None), (1, "tensorwise", False)])
def test_fp8_param_gather_sends_fp8_bytes_bit_identical(distributed, stage, recipe, p2p):
    """``fp8_param_gather`` at dp 2 (bf16 parameters): losses, reduced grads, fp32 masters and the final
    (exact) parameters bit-identical to the run without it over 3 steps, a resume from its state dicts too;
    the step's gathers send the FP8 weights in 1 byte per element instead of 2 (p2p: exactly; the collective
    pads each rank's message to the largest)."""
    plain = distributed(2, _fp8_gather_run, stage, recipe, False, p2p)
    fp8 = distributed(2, _fp8_gather_run, stage, recipe, True, p2p)
    for rank, (ref, mine) in enumerate(zip(plain, fp8)):
        _assert_same_training(rank, ref, mine)
        _assert_fp8_gather_bytes(rank, ref, mine, p2p, 8)


def _assert_fp8_gather_bytes(rank, ref, mine, p2p, n_weights):
    """ZeRO-1/2: each step's gather sent the whole shard without the flag and, with it, the other parameters'
    bytes plus one byte per FP8 element (p2p; the collective: less); all ``n_weights`` hold their scale."""
    ref_steps, (steps, split) = ref[0], (mine[0], mine[4])
    fp8_elements, other_bytes, whole_bytes, (copies, weights) = split
    assert fp8_elements > 0
    for step, ((*_, sent_plain, _), (*_, sent_fp8, _)) in enumerate(zip(ref_steps, steps)):
        assert sent_plain == whole_bytes, f"rank {rank} step {step}: the plain gather sent {sent_plain}"
        if p2p is None:  # the FP8 weights' share halves: 2 bytes per element -> 1
            assert sent_fp8 - other_bytes == fp8_elements, (
                f"rank {rank} step {step}: {sent_fp8} bytes sent, {other_bytes} of them other parameters; "
                f"expected {fp8_elements} FP8 bytes (bf16: {2 * fp8_elements})")
        else:
            assert sent_fp8 < sent_plain
    assert copies == weights == n_weights, f"rank {rank}: {copies} of {weights} FP8 weights hold their scale"


@pytest.mark.parametrize("recipe,p2p", [("tensorwise", None), ("delayed", None), ("tensorwise", False)])
def test_zero3_fp8_param_gather_sends_fp8_bytes_bit_identical(distributed, recipe, p2p):
    """ZeRO-3 with ``fp8_param_gather`` at dp 2 (bf16 parameters): bit-identical to the run without it as at
    stages 1-2 (3 steps, a resume). Each unit's gather (every micro-batch's forward and backward; the same
    buckets in the same order with and without the flag) sends the FP8 weights of this rank's shard in 1 byte
    per element: p2p exactly the shard's other parameters' bytes plus one byte per FP8 element (the plain
    gather: the whole shard); delayed scaling's first step (not calibrated yet) gathers as before. The weights'
    amaxes are all-reduced once per bucket and step, not per gather."""
    plain = distributed(2, _fp8_gather_run, 3, recipe, False, p2p)
    fp8 = distributed(2, _fp8_gather_run, 3, recipe, True, p2p)
    for rank, (ref, mine) in enumerate(zip(plain, fp8)):
        _assert_same_training(rank, ref, mine)
        _assert_zero3_fp8_gather_bytes(rank, ref, mine, recipe, p2p, 8)


def _assert_zero3_fp8_gather_bytes(rank, ref, mine, recipe, p2p, n_weights):
    """ZeRO-3: the same gathers with and without the flag; each sent (p2p) its shard's other bytes plus one
    byte per FP8 element for the buckets holding FP8 weights (delayed: from the second step); one amax
    all-reduce per such bucket and step; all ``n_weights`` hold their scale."""
    ref_steps, steps, buckets, (copies, weights) = ref[0], mine[0], mine[5], mine[4][3]
    for step, ((*_, sent_plain, (log_plain, reduces_plain)), (*_, sent, (log, reduces))) in enumerate(
            zip(ref_steps, steps)):
        assert log == log_plain and all(fp8 for _, fp8 in log), f"rank {rank} step {step}: gathers {log}"
        calibrated = recipe != "delayed" or step > 0
        in_fp8 = [b for b, _ in log if buckets[b][3] and calibrated]
        assert len(in_fp8) > len(set(in_fp8)) > 0 or not calibrated, f"rank {rank} step {step}: {in_fp8}"
        assert sent_plain == sum(buckets[b][2] for b, _ in log), f"rank {rank} step {step}: {sent_plain}"
        expected = sum(buckets[b][0] + buckets[b][1] if b in in_fp8 else buckets[b][2] for b, _ in log)
        if p2p is None:  # the FP8 weights' share halves: 2 bytes per element -> 1
            assert sent == expected, f"rank {rank} step {step}: {sent} bytes sent, expected {expected}"
        else:
            assert sent < sent_plain if in_fp8 else sent == sent_plain
        assert reduces - reduces_plain == len(set(in_fp8)), f"rank {rank} step {step}: all-reduces"
    assert copies == weights == n_weights, f"rank {rank}: {copies} of {weights} FP8 weights hold their scale"


def _write_shard_outside_the_step():
    """A ZeRO-3 FP8 run whose shards are written in place between forwards, outside the optimizer step and
    ``load_full``: the next FP8 gather refuses (its cached amaxes would be stale). Returns the error."""
    from megatron_core import initialize_model_parallel
    state = initialize_model_parallel(tensor_model_parallel_size=1)
    ddp, _ = _build_zero(3, "tensorwise", True, None, state)
    input_ids, positions, labels = make_batch(seed=0)
    with torch.no_grad():
        ddp(input_ids, positions, labels=labels)
        for bucket in ddp.buckets:
            bucket.param_shard.mul_(1.0)
        with pytest.raises(RuntimeError, match="written in place outside the optimizer step") as error:
            ddp(input_ids, positions, labels=labels)
    return str(error.value)


def test_zero3_fp8_param_gather_refuses_a_shard_written_outside_the_step(distributed):
    for message in distributed(2, _write_shard_outside_the_step):
        assert "ddp.start_param_sync()" in message
