"""Pipeline schedules on gloo ranks against forward_backward_no_pipelining of the whole model on one rank:
losses and every weight gradient (fp32), forward-only evaluation, tied embeddings after a step, the
in-flight activation bound, failure propagation, and the timeline outputs."""
import importlib
import json
import time

import pytest
import torch

from megatron_core import destroy_model_parallel, initialize_model_parallel
from megatron_core.models import GPTModel
from megatron_core.pipeline_parallel import PipelineError, Timeline, get_forward_backward_func
from megatron_core.pipeline_parallel.timeline import COMPUTE, gather_timelines, summarize, write_chrome_trace, write_png
from tests.model_helpers import DIVISIBLE_BY, SEQ, VOCAB, make_batch, tiny_config, unshard

MICRO_BATCH = 2
TOL = dict(rtol=1e-5, atol=1e-6)


def _batches(num_microbatches):
    return [dict(zip(("tokens", "positions", "labels"), make_batch(seed=mb))) for mb in range(num_microbatches)]


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["positions"], labels=batch["labels"])

    def loss_func(per_token_loss):
        loss = per_token_loss.mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def _build_chunks(state, num_layers, vpp, tied=True, **overrides):
    config = tiny_config(num_layers=num_layers, tensor_model_parallel_size=state.tp_size,
                         pipeline_model_parallel_size=state.pp_size, virtual_pipeline_model_parallel_size=vpp,
                         **overrides)
    chunks = []
    torch.manual_seed(1234)
    for vp in range(vpp or 1):
        torch.manual_seed(1234)  # every chunk draws the same base seed, as the whole model does
        chunks.append(GPTModel(config, parallel_state=state, vocab_size=VOCAB, max_sequence_length=SEQ,
                               make_vocab_size_divisible_by=DIVISIBLE_BY, vp_stage=vp if vpp else None,
                               pre_process=state.is_first_model_chunk(vp) if vpp else state.is_pipeline_first_stage,
                               post_process=state.is_last_model_chunk(vp) if vpp else state.is_pipeline_last_stage,
                               share_embeddings_and_output_weights=tied))
    return config, chunks


def _global_grads(config, state, chunks):
    """{global parameter name: (grad, tp partition dim, stride)} for this rank's chunks."""
    grads = {}
    for vp, chunk in enumerate(chunks):
        offset = config.pipeline_layer_range(state.pp_rank, vp if state.vpp_size else None)[0]
        for name, param in chunk.named_parameters():
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(int(parts[2]) + offset)
            dim = param.partition_dim if param.tensor_model_parallel else None
            grads[".".join(parts)] = (param.grad.clone(), dim, param.partition_stride)
    return grads


def _pipeline_run(tp, pp, vpp, num_layers, num_microbatches, forward_only=False, tied=True, fail_at=None,
                  zero_bubble=False, zero_bubble_defer="all", **overrides):
    state = initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                      virtual_pipeline_model_parallel_size=vpp)
    config, chunks = _build_chunks(state, num_layers, vpp, tied, **overrides)
    batches = _batches(num_microbatches)
    iterators = [iter(batches) for _ in chunks] if vpp else iter(batches)
    step = _forward_step
    if fail_at is not None and state.pp_rank == fail_at[0]:
        def step(data_iterator, model, _count=[0]):  # noqa: B006 - a per-run counter
            _count[0] += 1
            if _count[0] == fail_at[1]:
                raise ValueError(f"boom on pipeline rank {state.pp_rank}")
            return _forward_step(data_iterator, model)
    timeline = Timeline()
    schedule = get_forward_backward_func(pp, vpp, zero_bubble=zero_bubble,
                                         zero_bubble_defer=zero_bubble_defer if zero_bubble else None)
    losses = schedule(forward_step_func=step, data_iterator=iterators, model=chunks if vpp else chunks[0],
                      num_microbatches=num_microbatches, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
                      forward_only=forward_only, parallel_state=state, timeline=timeline)
    grads = {} if forward_only else _global_grads(config, state, chunks)
    result = dict(losses=[loss["lm loss"] for loss in losses], grads=grads, pp_rank=state.pp_rank,
                  tp_rank=state.tp_rank, max_in_flight=timeline.max_in_flight,
                  kinds=[(e.kind, e.microbatch) for e in timeline.events if e.kind in COMPUTE])
    destroy_model_parallel(state)
    return result


def _reference(num_layers, num_microbatches, forward_only=False, tied=True, **overrides):
    """The whole model on one process through forward_backward_no_pipelining."""
    state = initialize_model_parallel()
    config, (model,) = _build_chunks(state, num_layers, None, tied, **overrides)
    schedule = get_forward_backward_func(1)
    losses = schedule(forward_step_func=_forward_step, data_iterator=iter(_batches(num_microbatches)), model=model,
                      num_microbatches=num_microbatches, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
                      forward_only=forward_only, parallel_state=state)
    grads = {} if forward_only else {name: g for name, (g, _, _) in _global_grads(config, state, [model]).items()}
    return [loss["lm loss"] for loss in losses], grads


def _check_against_reference(results, reference, tp, tied=True):
    ref_losses, ref_grads = reference
    last = [r for r in results if r["losses"]]
    assert last and all(torch.allclose(torch.stack(r["losses"]), torch.stack(ref_losses), **TOL) for r in last)
    merged = {}
    for name in {n for r in results for n in r["grads"]}:
        holders = sorted((r for r in results if name in r["grads"]), key=lambda r: (r["pp_rank"], r["tp_rank"]))
        by_stage = {}
        for r in holders:
            by_stage.setdefault(r["pp_rank"], []).append(r["grads"][name])
        for stage, shards in by_stage.items():  # a tied weight lives on two stages: both must match
            merged.setdefault(name, []).append(unshard([g for g, _, _ in shards], shards[0][1], shards[0][2]))
    if tied and "output_layer.weight" in merged:
        merged.setdefault("embedding.word_embeddings.weight", []).extend(merged.pop("output_layer.weight"))
    assert merged.keys() == ref_grads.keys()
    for name, copies in merged.items():
        for grad in copies:
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("pp, m", [(2, 2), (2, 4), (2, 3), (4, 4), (4, 8), (4, 5)])
def test_1f1b_matches_no_pipelining(distributed, pp, m):
    _check_against_reference(distributed(pp, _pipeline_run, 1, pp, None, 4, m), _reference(4, m), 1)


def test_1f1b_with_tensor_parallel_and_untied_embeddings(distributed):
    results = distributed(4, _pipeline_run, 2, 2, None, 4, 3, tied=False)
    _check_against_reference(results, _reference(4, 3, tied=False), 2, tied=False)


@pytest.mark.parametrize("pp, m, layers", [(2, 2, 4), (2, 4, 4), (2, 6, 8), (3, 3, 6), (3, 9, 6), (4, 4, 8), (4, 8, 8)])
def test_interleaved_matches_no_pipelining(distributed, pp, m, layers):
    _check_against_reference(distributed(pp, _pipeline_run, 1, pp, 2, layers, m), _reference(layers, m), 1)


@pytest.mark.parametrize("vpp", [None, 2])
def test_forward_only_equals_evaluation_loss(distributed, vpp):
    ref_losses, _ = _reference(4, 4, forward_only=True)
    results = distributed(2, _pipeline_run, 1, 2, vpp, 4, 4, forward_only=True)
    assert torch.allclose(torch.stack(results[-1]["losses"]), torch.stack(ref_losses), **TOL)
    assert results[0]["losses"] == [] and results[0]["grads"] == {}


def test_in_flight_activations_stay_within_the_1f1b_bound(distributed):
    results = distributed(4, _pipeline_run, 1, 4, None, 4, 8)
    assert [r["max_in_flight"] for r in results] == [4, 3, 2, 1]  # p - r micro-batches held by rank r


def test_failing_rank_makes_the_others_fail_with_its_error(distributed):
    start = time.monotonic()
    with pytest.raises((PipelineError, ValueError), match="boom on pipeline rank 2") as info:
        distributed(4, _pipeline_run, 1, 4, None, 4, 8, fail_at=(2, 3))
    assert time.monotonic() - start < 30
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "were still running" not in notes  # every rank failed by itself: none hung
    for rank in (0, 1, 3):
        assert f"rank {rank}" in notes or f"raised on rank {rank}" in notes


class _CountingStore:
    """Wraps the default store and counts look-ups (the hot path must not make one per receive)."""

    def __init__(self, store):
        self.store, self.lookups = store, 0

    def check(self, keys):
        self.lookups += 1
        return self.store.check(keys)

    def __getattr__(self, name):
        return getattr(self.store, name)


def _store_lookups_in_a_step():
    from megatron_core.pipeline_parallel import executor
    original = executor._default_store
    counting = _CountingStore(original())
    executor._default_store = lambda: counting
    try:
        result = _pipeline_run(1, 2, None, 4, 8)
    finally:
        executor._default_store = original
    return counting.lookups, result["losses"]


def test_receives_make_no_store_round_trip(distributed):
    results = distributed(2, _store_lookups_in_a_step)
    assert [lookups for lookups, _ in results] == [0, 0]  # 8 receives per rank, none asks the store
    assert len(results[1][1]) == 8


def _tied_after_step():
    state = initialize_model_parallel(pipeline_model_parallel_size=2)
    config, (model,) = _build_chunks(state, 4, None)
    schedule = get_forward_backward_func(2)
    schedule(forward_step_func=_forward_step, data_iterator=iter(_batches(4)), model=model, num_microbatches=4,
             seq_length=SEQ, micro_batch_size=MICRO_BATCH, parallel_state=state)
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    weight = (model.embedding.word_embeddings.weight if state.is_pipeline_first_stage
              else model.output_layer.weight).detach().clone()
    destroy_model_parallel(state)
    return weight


def test_tied_embeddings_stay_identical_after_a_step(distributed):
    first, last = distributed(2, _tied_after_step)
    assert torch.equal(first, last)


def _embedding_collectives_per_step(tied):
    """The collectives finalize_model_grads runs over the embedding group, in each of three steps."""
    finalize_module = importlib.import_module("megatron_core.distributed.finalize_model_grads")
    state = initialize_model_parallel(pipeline_model_parallel_size=2)
    _, (model,) = _build_chunks(state, 4, None, tied)
    counts, original = [], finalize_module.dist.all_reduce

    def counting(tensor, *args, group=None, **kwargs):
        counts[-1] += group is state.embedding_group
        return original(tensor, *args, group=group, **kwargs)
    finalize_module.dist.all_reduce = counting
    try:
        for _ in range(3):
            counts.append(0)
            get_forward_backward_func(2)(forward_step_func=_forward_step, data_iterator=iter(_batches(2)),
                                         model=model, num_microbatches=2, seq_length=SEQ,
                                         micro_batch_size=MICRO_BATCH, parallel_state=state)
    finally:
        finalize_module.dist.all_reduce = original
        destroy_model_parallel(state)
    return counts


def test_untied_stages_check_the_embedding_group_once(distributed):
    """Without tied embeddings the ends agree once (one scalar all-reduce), then finalize runs no collective
    over the embedding group (the last stage no longer waits for the first stage's last backward); tied
    embeddings are reduced every step."""
    assert distributed(2, _embedding_collectives_per_step, False) == [[1, 0, 0]] * 2
    assert distributed(2, _embedding_collectives_per_step, True) == [[2, 2, 2]] * 2


def _timeline_files(directory):
    state = initialize_model_parallel(pipeline_model_parallel_size=2)
    _, (model,) = _build_chunks(state, 4, None)
    timeline = Timeline()
    get_forward_backward_func(2)(forward_step_func=_forward_step, data_iterator=iter(_batches(4)), model=model,
                                 num_microbatches=4, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
                                 parallel_state=state, timeline=timeline)
    per_rank = gather_timelines(timeline, state.pp_group)
    if state.pp_rank == 0:
        write_chrome_trace(per_rank, f"{directory}/trace.json")
        write_png(per_rank, f"{directory}/schedule.png")
    destroy_model_parallel(state)
    return summarize(per_rank, (2 - 1) / 4), [e["kind"] for e in per_rank[state.pp_rank]]


def test_timeline_writes_trace_and_picture(distributed, tmp_path):
    (summary, kinds), _ = distributed(2, _timeline_files, str(tmp_path))
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {e["tid"] for e in trace} == {0, 1}
    assert sum(e["cat"] == "forward" for e in trace) == 8 and sum(e["cat"] == "backward" for e in trace) == 8
    assert (tmp_path / "schedule.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bubble formula (p-1)/(v*m) = 0.250" in summary and "pp rank 1: measured bubble" in summary
    assert {"forward", "backward", "send", "recv"} <= set(kinds)


def _invalid(kind):
    state = initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    try:
        _, chunks = _build_chunks(state, 4, 2)
        kwargs = dict(forward_step_func=_forward_step, data_iterator=[iter([]), iter([])], model=chunks,
                      num_microbatches=4, seq_length=SEQ, micro_batch_size=MICRO_BATCH, parallel_state=state)
        if kind == "microbatches":
            kwargs["num_microbatches"] = 3
        elif kind == "chunks":
            kwargs["model"] = chunks[:1]
        elif kind == "iterators":
            kwargs["data_iterator"] = iter([])
        get_forward_backward_func(2, 2)(**kwargs)
    finally:
        destroy_model_parallel(state)


@pytest.mark.parametrize("kind, fragment", [
    ("microbatches", "num_microbatches 3 is not divisible by pipeline_model_parallel_size 2"),
    ("chunks", "expected 2 model chunk"),
    ("iterators", "one data iterator per model chunk"),
])
def test_invalid_settings_raise_before_any_communication(distributed, kind, fragment):
    with pytest.raises(ValueError, match=fragment) as info:
        distributed(2, _invalid, kind)
    assert not any("were still running" in note for note in info.value.__notes__)


def test_schedule_selection_rejects_bad_sizes():
    with pytest.raises(ValueError, match="vpp_size 2 needs pp_size > 1"):
        get_forward_backward_func(1, 2)
