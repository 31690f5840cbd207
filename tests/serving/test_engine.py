"""The continuous-batching engine: block pool, paged step, scheduler budget, and tokens equal to ``generate``'s
(greedy and seeded sampling) whatever batch a request shares, in one process and at tp 2 x pp 2."""
from __future__ import annotations

import pytest
import torch

from megatron_core import initialize_model_parallel
from megatron_core.config import TransformerConfig
from megatron_core.inference import generate
from megatron_core.inference.engine import InferenceEngine
from megatron_core.inference.paged_cache import BlockPool, PagedKVCache, PagedStep, PoolExhausted, StepEntry
from megatron_core.inference.scheduler import QueueFull, Request, SamplingParams, Scheduler
from megatron_core.models import GPTModel

VOCAB, POSITIONS = 96, 64


def tiny_model(state, seed: int = 0) -> GPTModel:
    """hidden 32, 2 layers, GQA, rope, swiglu, RMSNorm; weights std 0.3 (peaked logits: no near ties)."""
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=64, max_position_embeddings=POSITIONS, hidden_dropout=0.0,
                               attention_dropout=0.0, position_embedding_type="rope", activation="swiglu",
                               normalization="RMSNorm", init_method_std=0.3, tensor_model_parallel_size=state.tp_size,
                               pipeline_model_parallel_size=state.pp_size)
    torch.manual_seed(seed)
    return GPTModel(config, parallel_state=state, vocab_size=VOCAB, max_sequence_length=POSITIONS,
                    pre_process=state.is_pipeline_first_stage, post_process=state.is_pipeline_last_stage,
                    parallel_output=False).eval()


def prompts(lengths=(3, 9, 17, 1, 30, 5), seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


class WordTokenizer:
    """ids <-> "w<id>" words joined by spaces; eod = 95."""

    eod = 95

    def encode(self, text: str) -> list[int]:
        return [int(word[1:]) for word in text.split()]

    def decode(self, ids) -> str:
        return " ".join(f"w{i}" for i in ids)


def test_block_pool_hands_out_lowest_ids_and_catches_exhaustion_and_double_free():
    pool = BlockPool(4, block_size=8)
    assert (pool.blocks_for(1), pool.blocks_for(8), pool.blocks_for(9)) == (1, 1, 2)
    first = pool.allocate(3)
    assert first == [0, 1, 2] and (pool.num_free, pool.num_used) == (1, 3)
    with pytest.raises(PoolExhausted, match="2 blocks requested, 1 of 4 free"):
        pool.allocate(2)
    pool.free([1])
    assert pool.allocate(2) == [1, 3] and pool.num_free == 0 and pool.peak_used == 4
    pool.free([0, 1, 2, 3])
    with pytest.raises(ValueError, match="block 2 is not in use"):
        pool.free([2])
    assert pool.num_free == 4


def test_paged_step_writes_each_token_into_its_slot_and_masks_other_requests():
    cache = PagedKVCache(num_blocks=4, block_size=2)
    # request a: 2 tokens cached in block 3, 1 new (position 2 -> block 1); request b: 2 new in block 0
    step = PagedStep(cache, [StepEntry((3, 1), 2, (7,)), StepEntry((0,), 0, (5, 6))], torch.device("cpu"))
    assert step.tokens.tolist() == [[7, 5, 6]] and step.positions.tolist() == [[2, 0, 1]]
    assert step.write_slots.tolist() == [2, 0, 1] and step.read_slots.tolist() == [6, 7, 2, 0, 1]
    expected = torch.tensor([[0, 0, 0, 1, 1], [1, 1, 1, 0, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    assert torch.equal(step.attention_mask(3, torch.device("cpu"))[0, 0], expected)
    key = torch.arange(3.0).view(3, 1, 1, 1).expand(3, 1, 2, 4).contiguous()
    keys, values = step.update(1, key, key + 10)
    assert keys.shape == (5, 1, 2, 4) and keys[2:, 0, 0, 0].tolist() == [0.0, 1.0, 2.0]
    assert torch.equal(cache.key_value[1][1][2], key[0, 0] + 10)
    with pytest.raises(ValueError, match="runs its 3 packed tokens as batch 1"):
        step.check_room(3, 2)


def _request(n: int, prompt_len: int, max_tokens: int) -> Request:
    return Request(f"r{n}", tuple(range(prompt_len)), SamplingParams(max_tokens=max_tokens), seed=0)


def test_scheduler_mixes_decodes_with_chunked_prefills_within_the_token_budget():
    scheduler = Scheduler(BlockPool(6, 4), max_tokens_per_step=8, max_batch_size=3, max_queued=2)
    for n, length in enumerate((5, 6)):
        scheduler.add(_request(n, length, max_tokens=3))  # 5 + 2 positions: 2 blocks; 6 + 2: 2 blocks
    plan = scheduler.schedule()
    assert [(e.request_id, e.start, len(e.tokens), e.sample) for e in plan.entries] == [
        ("r0", 0, 5, True), ("r1", 0, 3, False)]  # r1's prompt is cut at the budget
    scheduler.advance(plan, [(11, -0.5, []), (None, 0.0, [])])
    scheduler.add(_request(2, 9, max_tokens=1))  # 9 positions: 3 blocks, only 2 free: it waits
    plan = scheduler.schedule()
    assert [(e.request_id, e.start, e.tokens) for e in plan.entries] == [("r0", 5, (11,)), ("r1", 3, (3, 4, 5))]
    assert len(scheduler.waiting) == 1 and scheduler.pool.num_free == 2
    scheduler.advance(plan, [(12, -0.1, []), (13, -0.2, [])])
    scheduler.finish(scheduler.running[0], "length")  # r0 ends: its 2 blocks return, r2 fits
    plan = scheduler.schedule()
    assert [(e.request_id, len(e.tokens)) for e in plan.entries] == [("r1", 1), ("r2", 7)]
    assert plan.finished == ("r0",) and sum(len(e.tokens) for e in plan.entries) <= 8
    with pytest.raises(ValueError, match="needs 7 cache blocks .* the whole pool holds 6"):
        scheduler.add(_request(3, 20, max_tokens=6))
    scheduler.add(_request(4, 1, max_tokens=1))
    scheduler.add(_request(5, 1, max_tokens=1))
    with pytest.raises(QueueFull):
        scheduler.add(_request(6, 1, max_tokens=1))


@pytest.mark.parametrize("budget,batch", [(16, 4), (64, 64)])
def test_greedy_tokens_and_logprobs_equal_generate_whatever_batch_they_share(budget, batch):
    state = initialize_model_parallel()
    model = tiny_model(state)
    reference = [generate(model, state, p, max_new_tokens=12) for p in prompts()]
    engine = InferenceEngine(model, state, num_blocks=40, block_size=4, max_tokens_per_step=budget,
                             max_batch_size=batch)
    requests = [engine.add_request(p, SamplingParams(max_tokens=12, prompt_logprobs=True)) for p in prompts()]
    engine.run_until_done()
    for request, ref in zip(requests, reference):
        assert request.generated == ref["tokens"] and request.finish_reason == "length"
        torch.testing.assert_close(request.logprobs, ref["generated_logprobs"], rtol=0, atol=1e-4)
        torch.testing.assert_close(request.prompt_logprobs, ref["prompt_logprobs"], rtol=0, atol=1e-4)
    assert engine.scheduler.pool.num_free == 40 and 0 < engine.scheduler.pool.peak_used <= 40


def test_seeded_sampling_is_reproducible_and_equals_generate_in_any_batch():
    state = initialize_model_parallel()
    model = tiny_model(state)
    params = dict(temperature=0.9, top_k=30, top_p=0.95)
    target = prompts()[2]
    reference = generate(model, state, target, max_new_tokens=16, greedy=False, seed=7, **params)["tokens"]
    engine = InferenceEngine(model, state, num_blocks=64, block_size=4, max_tokens_per_step=16, max_batch_size=8)
    runs = []
    for companions in (prompts()[:2], prompts()[3:]):  # the same request with different neighbours
        for p in companions:
            engine.add_request(p, SamplingParams(max_tokens=10, temperature=1.0, seed=1))
        request = engine.add_request(target, SamplingParams(max_tokens=16, seed=7, **params))
        engine.run_until_done()
        runs.append(request.generated)
    other = engine.add_request(target, SamplingParams(max_tokens=16, seed=8, **params))
    engine.run_until_done()
    assert runs[0] == runs[1] == reference
    assert other.generated != reference


def _tokens_until(words: list[str], stop: str) -> int:
    """How many words it takes for their text to contain ``stop``."""
    return next(k for k in range(1, len(words) + 1) if stop in " ".join(words[:k]))


def test_stop_strings_stop_tokens_and_eos_end_a_request():
    state = initialize_model_parallel()
    model = tiny_model(state)
    engine = InferenceEngine(model, state, num_blocks=64, block_size=4, tokenizer=WordTokenizer())
    target = prompts()[1]
    free = engine.add_request(target, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.run_until_done()
    words = [f"w{t}" for t in free.generated]
    stop = f" {words[3]}"
    by_string = engine.add_request(target, SamplingParams(max_tokens=8, stop=(stop,), ignore_eos=True))
    by_token = engine.add_request(target, SamplingParams(max_tokens=8, stop_token_ids=(free.generated[2],),
                                                         ignore_eos=True))
    by_eos = InferenceEngine(model, state, num_blocks=64, block_size=4, tokenizer=WordTokenizer(),
                             eos_id=free.generated[1])
    eos_request = by_eos.add_request(target, SamplingParams(max_tokens=8))
    outputs = engine.run_until_done()
    eos_outputs = by_eos.run_until_done()
    text = " ".join(words)
    assert by_string.finish_reason == "stop"
    assert by_string.generated == free.generated[:_tokens_until(words, stop)]
    assert "".join(o.text for o in outputs if o.request is by_string) == text[:text.index(stop)]
    stop_at = free.generated.index(free.generated[2])
    assert by_token.finish_reason == "stop" and by_token.generated == free.generated[:stop_at + 1]
    assert "".join(o.text for o in outputs if o.request is by_token) == " ".join(words[:stop_at])
    eos_at = free.generated.index(free.generated[1])
    assert eos_request.finish_reason == "stop" and eos_request.generated == free.generated[:eos_at + 1]
    assert "".join(o.text for o in eos_outputs) == " ".join(words[:eos_at])
    assert "".join(o.text for o in outputs if o.request is free) == ""  # (its outputs came from the first run)
    assert engine.scheduler.pool.num_free == 64


def test_bad_requests_are_refused_with_the_values_and_an_abort_frees_the_blocks():
    state = initialize_model_parallel()
    engine = InferenceEngine(tiny_model(state), state, num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="maximum context length is 64 tokens, but 70 were requested"):
        engine.add_request(list(range(60)), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1, got 0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match=r"outside the vocab \[0, 96\)"):
        engine.add_request([1, 96], SamplingParams())
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.add_request([], SamplingParams())
    request = engine.add_request(prompts()[4], SamplingParams(max_tokens=2))  # 31 positions: all 8 blocks
    waiting = engine.add_request([1, 2], SamplingParams(max_tokens=2))
    engine.step()
    assert engine.scheduler.pool.num_free == 0 and waiting in engine.scheduler.waiting
    assert engine.abort(request.request_id).finished and request.finish_reason == "abort"
    assert engine.scheduler.pool.num_free == 8
    engine.run_until_done()
    assert waiting.finish_reason == "length" and engine.scheduler.pool.num_free == 8


def _engine_at_layout(tp: int, pp: int):
    state = initialize_model_parallel(tp, pp)
    model = tiny_model(state)
    reference = [generate(model, state, p, max_new_tokens=10)["tokens"] for p in prompts()]  # collective
    engine = InferenceEngine(model, state, max_memory_bytes=1 << 16, block_size=4, max_tokens_per_step=16,
                             max_batch_size=4)
    if state.rank != 0:
        engine.follow()
        return None
    requests = [engine.add_request(p, SamplingParams(max_tokens=10)) for p in prompts()]
    engine.run_until_done()
    engine.stop()
    return reference, [r.generated for r in requests], engine.scheduler.pool.num_free, engine.scheduler.pool.num_blocks


def test_engine_at_tp2_pp2_gives_generates_tokens(distributed):
    reference, tokens, free, total = distributed(4, _engine_at_layout, 2, 2)[0]
    assert tokens == reference and free == total
    single = initialize_model_parallel()
    assert reference == [generate(tiny_model(single), single, p, max_new_tokens=10)["tokens"] for p in prompts()]


def test_text_stream_holds_back_a_possible_stop_string_and_cuts_before_it():
    from megatron_core.inference.text import TextStream
    letters = {1: "ab", 2: "c", 3: "de", 4: "\ufffd"}
    stream = TextStream(lambda ids: "".join(letters[i] for i in ids), stop=("cd",), hidden_ids=(9,))
    assert stream.push([1]) == ("ab", False)
    assert stream.push([1, 2]) == ("", False)  # "c" could start "cd"
    assert stream.push([1, 2, 9, 3]) == ("", True)  # "abcde" holds "cd": the text ends at "ab"
    other = TextStream(lambda ids: "".join(letters[i] for i in ids))
    assert other.push([1, 4]) == ("ab", False)  # an unfinished character waits
    assert other.finish([1, 4, 2]) == "\ufffdc"


def test_a_step_that_fails_fails_its_requests_only(monkeypatch):
    state = initialize_model_parallel()
    engine = InferenceEngine(tiny_model(state), state, num_blocks=32, block_size=4)
    failing = engine.add_request(prompts()[0], SamplingParams(max_tokens=4))
    original = engine._execute

    def broken(plan):
        monkeypatch.setattr(engine, "_execute", original)  # only the first step breaks
        raise RuntimeError("injected")
    monkeypatch.setattr(engine, "_execute", broken)
    outputs = engine.step()
    assert [o.request for o in outputs] == [failing] and failing.finish_reason == "error"
    assert engine.scheduler.pool.num_free == 32
    later = engine.add_request(prompts()[0], SamplingParams(max_tokens=4))
    engine.run_until_done()
    assert later.finish_reason == "length" and len(later.generated) == 4
