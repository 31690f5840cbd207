"""Continuous batching against serving one request at a time, on the CPU, with a tiny model.

    python scripts/bench_serving.py                      # 64 requests, 5 alternating rounds
    python scripts/bench_serving.py --rounds 7 --rate 200 --output-json bench_serving.json

A tiny Llama (transformers, random weights) is imported with tools/checkpoint_convert.py and loaded with
``load_gpt_from_checkpoint``. 64 requests (prompts of 8-32 tokens, 8-32 greedy new tokens) arrive over time
(Poisson, ``--rate`` per second, the same schedule every round) at an ``InferenceEngine`` driven in this process
(no HTTP): "batched" with up to 64 requests per step and a 256-token budget, "one by one" with one request per
step, and "generate": ``generate`` (the contiguous-cache path of tools/generate.py) called for one request after
the other. Each round runs the three, in alternating order. Printed: generated tokens per second (arrival of the first
request to the end of the last), time to first token p50 / p90, and the ratio, as the median of the rounds with
their range. Asserted: the blocks in use never exceed the pool and the pool is full again after each run, and
every request's tokens equal tools/generate.py's greedy tokens for its prompt.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tools"))

import generate as generate_tool  # noqa: E402
from checkpoint_convert import main as convert  # noqa: E402

from megatron_core import initialize_model_parallel  # noqa: E402
from megatron_core.inference import generate, load_gpt_from_checkpoint  # noqa: E402
from megatron_core.inference.engine import InferenceEngine  # noqa: E402
from megatron_core.inference.scheduler import SamplingParams  # noqa: E402

VOCAB, POSITIONS = 256, 128


def tiny_checkpoint(folder: str) -> str:
    """A random tiny Llama (hidden 64, 2 layers, GQA), imported at tp 1; returns the checkpoint folder."""
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=POSITIONS, tie_word_embeddings=False,
                                      initializer_range=0.2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(os.path.join(folder, "hf"))
    ckpt = os.path.join(folder, "ckpt")
    status = convert(["--model-type", "GPT", "--loader", "hf", "--saver", "mcore", "--load-dir",
                      os.path.join(folder, "hf"), "--save-dir", ckpt, "--no-progress"])
    if status != 0:
        raise SystemExit(f"checkpoint_convert exited {status}")
    return ckpt


def workload(n: int, rate: float, seed: int) -> list[tuple[float, list[int], int]]:
    """``(arrival offset s, prompt ids, new tokens)`` per request: Poisson arrivals at ``rate`` per second."""
    g = torch.Generator().manual_seed(seed)
    gaps = torch.empty(n).exponential_(rate, generator=g)
    arrivals = (gaps.cumsum(0) - gaps[0]).tolist()
    lengths = torch.randint(8, 33, (n,), generator=g).tolist()
    new = torch.randint(8, 33, (n,), generator=g).tolist()
    return [(a, torch.randint(0, VOCAB - 1, (k,), generator=g).tolist(), m) for a, k, m in zip(arrivals, lengths, new)]


def serve(engine: InferenceEngine, requests, *, ignore_eos: bool = True) -> dict:
    """Feeds ``requests`` at their arrival times and steps until all end; returns tokens, timings, peak blocks."""
    pool, start, order, peak = engine.scheduler.pool, time.monotonic(), [], 0
    pending = list(requests)
    while pending or engine.has_work():
        now = time.monotonic() - start
        while pending and pending[0][0] <= now:
            arrival, prompt, new = pending.pop(0)
            request = engine.add_request(prompt, SamplingParams(max_tokens=new, ignore_eos=ignore_eos))
            request.arrival = start + arrival
            order.append(request)
        if engine.has_work():
            engine.step()
            peak = max(peak, pool.num_used)
            assert pool.num_used <= pool.num_blocks
        elif pending:
            time.sleep(max(0.0, pending[0][0] - (time.monotonic() - start)))
    end = time.monotonic()
    assert pool.num_free == pool.num_blocks, f"{pool.num_free} of {pool.num_blocks} blocks free after the run"
    ttft = sorted(r.first_token_time - r.arrival for r in order)
    return {"tokens": [r.generated for r in order], "seconds": end - start,
            "tokens_per_s": sum(len(r.generated) for r in order) / (end - start),
            "ttft_p50": ttft[len(ttft) // 2], "ttft_p90": ttft[int(len(ttft) * 0.9)], "peak_blocks": peak,
            "pool_blocks": pool.num_blocks}


def serve_with_generate(model, state, requests) -> dict:
    """The existing path, one request after the other in arrival order: ``generate`` (contiguous cache)."""
    start, tokens = time.monotonic(), []
    for arrival, prompt, new in requests:
        time.sleep(max(0.0, arrival - (time.monotonic() - start)))
        tokens.append(generate(model, state, prompt, max_new_tokens=new)["tokens"])
    seconds = time.monotonic() - start
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": sum(map(len, tokens)) / seconds,
            "ttft_p50": float("nan"), "ttft_p90": float("nan"), "peak_blocks": 0}


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} (range {min(values):.3g} - {max(values):.3g})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=160.0, help="arrivals per second (Poisson)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--num-blocks", type=int, default=128, help="cache blocks of 16 tokens (128: ~40 requests at once)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        ckpt = tiny_checkpoint(folder)
        state = initialize_model_parallel()
        model, _ = load_gpt_from_checkpoint(ckpt, state)
        requests = workload(args.requests, args.rate, seed=1)
        modes = {"batched": dict(max_batch_size=64, max_tokens_per_step=256),
                 "one_by_one": dict(max_batch_size=1, max_tokens_per_step=256), "generate": None}
        runs = {mode: [] for mode in modes}
        for round_index in range(args.rounds):
            for mode in (list(modes) if round_index % 2 == 0 else list(modes)[::-1]):
                if modes[mode] is None:
                    runs[mode].append(serve_with_generate(model, state, requests))
                    continue
                engine = InferenceEngine(model, state, num_blocks=args.num_blocks, block_size=16,
                                         max_sequence_length=POSITIONS, **modes[mode])
                runs[mode].append(serve(engine, requests))
        reference = []
        for _, prompt, new in requests:  # tools/generate.py's own code path, one request at a time
            tool_args = generate_tool.build_parser().parse_args(
                ["--load", ckpt, "--prompt-ids", ",".join(map(str, prompt)), "--greedy", "--max-new-tokens", str(new)])
            reference.append(generate_tool.run(tool_args)["tokens"])
    for mode, results in runs.items():
        for result in results:
            mismatched = [i for i, (a, b) in enumerate(zip(result["tokens"], reference)) if a != b]
            assert not mismatched, f"{mode}: requests {mismatched} differ from tools/generate.py's greedy tokens"
    ratio = [b["tokens_per_s"] / s["tokens_per_s"] for b, s in zip(runs["batched"], runs["one_by_one"])]
    ratio_generate = [b["tokens_per_s"] / s["tokens_per_s"] for b, s in zip(runs["batched"], runs["generate"])]
    report = {"requests": args.requests, "rate_per_s": args.rate, "rounds": args.rounds,
              "generated_tokens": sum(len(t) for t in reference), "pool_blocks": args.num_blocks,
              "torch_threads": torch.get_num_threads(),
              **{mode: {key: [r[key] for r in results] for key in ("tokens_per_s", "ttft_p50", "ttft_p90",
                                                                     "seconds", "peak_blocks")}
                 for mode, results in runs.items()}, "throughput_ratio": ratio,
              "throughput_ratio_vs_generate": ratio_generate}
    print(f"{args.requests} requests, Poisson {args.rate:g}/s, {report['generated_tokens']} greedy tokens, "
          f"{args.rounds} alternating rounds, pool {args.num_blocks} blocks x 16 tokens, "
          f"{torch.get_num_threads()} torch threads")
    for mode, results in runs.items():
        ttft = "" if mode == "generate" else (
            f", TTFT p50 {summary([r['ttft_p50'] * 1e3 for r in results])} ms, p90 "
            f"{summary([r['ttft_p90'] * 1e3 for r in results])} ms, peak blocks "
            f"{max(r['peak_blocks'] for r in results)}/{args.num_blocks}")
        print(f"  {mode:>10}: {summary([r['tokens_per_s'] for r in results])} tokens/s{ttft}")
    print(f"  throughput batched / engine one by one: {summary(ratio)}x; batched / generate() one by one: "
          f"{summary(ratio_generate)}x")
    print("  asserted: blocks in use <= pool and the pool full again after every run; every request's tokens "
          "= tools/generate.py's greedy tokens")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
