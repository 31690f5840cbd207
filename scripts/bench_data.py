"""Data pipeline benchmark: preprocessing throughput, index build time and memory vs dataset size.

Usage::

    python scripts/bench_data.py                       # 5M-token preprocessing, 10M and 100M-token indices
    python scripts/bench_data.py --preprocess-tokens 2e6 --index-tokens 1e7 5e7 --workers 1 2

Preprocessing: a synthetic jsonl corpus (standard-library source text cut into ~4 KB documents) is
tokenized with a 4000-piece sentencepiece BPE model trained on the fly, at each ``--workers`` count;
tokens/s counts output tokens. Indices: a synthetic dataset of the given token count (uint16 tokens,
documents of 1-2000 tokens) is written with ``IndexedDatasetBuilder``, then opened in a fresh process
that builds one epoch of ``GPTDataset`` indices (seq_length 2048) and reads 2000 random samples.
Memory is each measuring process's anonymous RSS (``RssAnon``: heap, not the page cache of the mapped
files) and its peak RSS; both should stay flat as the dataset grows. Every measurement runs in its
own subprocess so that peaks do not leak from one to the next.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np


def memory_mb() -> dict:
    """Current anonymous RSS and peak RSS of this process, in MB (Linux /proc)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "VmHWM", "VmRSS"):
                fields[key] = int(value.split()[0]) / 1024
    return fields


def make_jsonl(path: str, target_bytes: int) -> None:
    """Writes ~target_bytes of jsonl documents cut from standard-library sources."""
    from megatron_core.data.default_corpus import gather_documents

    text = "".join(gather_documents(min(target_bytes, 20_000_000)))
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target_bytes:
            for start in range(0, len(text), 4000):
                doc = text[start: start + 4000]
                f.write(json.dumps({"text": doc}) + "\n")
                written += len(doc)
                if written >= target_bytes:
                    break


def child_preprocess(args) -> dict:
    from megatron_core.data.preprocess import preprocess

    start = time.perf_counter()
    stats = {}
    workers = args.workers[0]
    preprocess([args.input], args.output, workers=workers, append_eod=True, log_interval=0,
               tokenizer_args=dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=args.model),
               progress=lambda s: stats.update(tokens=s.tokens, documents=s.documents))
    seconds = time.perf_counter() - start
    return {"workers": workers, "tokens": stats["tokens"], "seconds": seconds,
            "tokens_per_s": stats["tokens"] / seconds, **memory_mb()}


def child_write(args) -> dict:
    from megatron_core.data import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    start, tokens, docs = time.perf_counter(), 0, 0
    with IndexedDatasetBuilder(args.output, np.uint16) as builder:
        while tokens < args.tokens:
            n = int(min(rng.integers(1, 2000), args.tokens - tokens))
            builder.add_document(rng.integers(0, 32000, size=n, dtype=np.uint16))
            tokens, docs = tokens + n, docs + 1
    return {"tokens": tokens, "documents": docs, "write_seconds": time.perf_counter() - start, **memory_mb()}


def child_index(args) -> dict:
    from megatron_core.data import GPTDataset, GPTDatasetConfig, IndexedDataset

    before = memory_mb()["RssAnon"]
    start = time.perf_counter()
    indexed = IndexedDataset(args.output)
    open_seconds = time.perf_counter() - start
    start = time.perf_counter()
    dataset = GPTDataset(indexed, np.arange(len(indexed)), None, GPTDatasetConfig(seq_length=2048, seed=1),
                         cache_dir=tempfile.mkdtemp())
    build_seconds = time.perf_counter() - start
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for i in rng.integers(0, len(dataset), size=2000):
        dataset[int(i)]
    read_seconds = time.perf_counter() - start
    mem = memory_mb()
    return {"samples": len(dataset), "open_seconds": open_seconds, "index_build_seconds": build_seconds,
            "samples_per_s": 2000 / read_seconds, "rss_anon_growth_mb": mem["RssAnon"] - before, **mem}


def run_child(*argv: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench step {argv[:2]} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preprocess-tokens", type=float, default=5e6, help="approximate tokens to preprocess")
    parser.add_argument("--index-tokens", type=float, nargs="+", default=[1e7, 1e8], help="dataset sizes")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--child", choices=["preprocess", "write", "index"], help=argparse.SUPPRESS)
    parser.add_argument("--input", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps({"preprocess": child_preprocess, "write": child_write,
                          "index": child_index}[args.child](args)))
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        bench(args, scratch)


def bench(args, scratch: str) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import train_tokenizer

    print(f"machine: {os.cpu_count()} CPUs, python {sys.version.split()[0]}, numpy {np.__version__}")
    corpus = os.path.join(scratch, "corpus.jsonl")
    make_jsonl(corpus, int(args.preprocess_tokens * 3.3))  # ~3.3 bytes per token for this model on code
    model = train_tokenizer.train([corpus], os.path.join(scratch, "spm"), vocab_size=4000, input_sentence_size=200_000)
    print(f"\npreprocessing {os.path.getsize(corpus) / 1e6:.1f} MB jsonl, sentencepiece BPE 4000, --append-eod")
    print(f"{'workers':>8} {'tokens':>12} {'seconds':>8} {'tokens/s':>12} {'peak RSS MB':>12}")
    for workers in args.workers:
        r = run_child("--child", "preprocess", "--input", corpus, "--output", os.path.join(scratch, f"p{workers}"),
                      "--model", model, "--workers", str(workers))
        print(f"{workers:>8} {r['tokens']:>12,} {r['seconds']:>8.2f} {r['tokens_per_s']:>12,.0f} {r['VmHWM']:>12.0f}")
    print("\nindex build and memory (seq_length 2048, one epoch, 2000 random samples read)")
    print(f"{'tokens':>12} {'docs':>8} {'write s':>8} {'writer peak MB':>15} {'open s':>7} {'index s':>8} "
          f"{'samples/s':>10} {'RssAnon MB':>11} {'peak RSS MB':>12}")
    for tokens in args.index_tokens:
        prefix = os.path.join(scratch, f"synthetic_{int(tokens)}")
        w = run_child("--child", "write", "--output", prefix, "--tokens", str(int(tokens)))
        r = run_child("--child", "index", "--output", prefix)
        print(f"{w['tokens']:>12,} {w['documents']:>8,} {w['write_seconds']:>8.2f} {w['VmHWM']:>15.0f} "
              f"{r['open_seconds']:>7.3f} {r['index_build_seconds']:>8.3f} {r['samples_per_s']:>10,.0f} "
              f"{r['RssAnon']:>11.0f} {r['VmHWM']:>12.0f}")
        os.remove(prefix + ".bin")


if __name__ == "__main__":
    main()
