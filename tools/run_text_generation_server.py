"""Serve a checkpoint over HTTP: OpenAI-compatible completions and chat, Megatron-LM's ``PUT /api``, with
continuous batching over a paged key/value cache, at any tp x pp (Megatron-LM's script name).

    pip install '.[serve]'
    python tools/run_text_generation_server.py --load ckpt --port 5000
    torchrun --nproc-per-node 4 tools/run_text_generation_server.py --load ckpt \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --inference-max-memory 2000000000
    torchrun --nproc-per-node 2 tools/run_text_generation_server.py --load ckpt_tp2   # its own layout

    curl localhost:5000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"prompt": "def main(", "max_tokens": 32, "temperature": 0}'
    curl -X PUT localhost:5000/api -H 'Content-Type: application/json' \\
        -d '{"prompts": ["def main("], "tokens_to_generate": 32, "top_k": 1, "logprobs": true}'

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the Hugging Face tokenizer's chat template
when the checkpoint's tokenizer has one), ``GET /v1/models``, ``GET /health``, ``PUT /api``. Rank 0 serves HTTP
and schedules; the other ranks follow its plans. SIGTERM (or Ctrl-C) on rank 0 stops taking requests, lets
running ones finish for ``--drain-timeout`` seconds, cancels the rest, stops the other ranks and exits 0;
the other ranks ignore SIGTERM and leave when rank 0 tells them (torchrun forwards its SIGTERM to every rank,
then reports the signal in its own exit status).
"""
from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import signal
import sys
from typing import Optional, Sequence

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import generate as generate_tool  # noqa: E402  (tools/generate.py: layout and tokenizer from the checkpoint)

from megatron_core import initialize_model_parallel  # noqa: E402
from megatron_core.checkpointing import read_metadata  # noqa: E402
from megatron_core.inference import load_gpt_from_checkpoint  # noqa: E402
from megatron_core.inference.engine import InferenceEngine  # noqa: E402
from megatron_core.utils.errors import run_tool  # noqa: E402

PROG = "run_text_generation_server.py"
logger = logging.getLogger(PROG)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="OpenAI-compatible text generation server",
                                allow_abbrev=False)
    p.add_argument("--load", required=True)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--model-name", default=None, help="the id /v1/models lists (default: the --load folder name)")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--inference-max-memory", type=int, default=None,
                       help="bytes of key/value cache per rank (default: --inference-max-batch-size sequences of "
                            "the full context)")
    cache.add_argument("--inference-max-blocks", type=int, default=None, help="the cache size in blocks instead")
    p.add_argument("--inference-block-size", type=int, default=16, help="tokens per cache block")
    p.add_argument("--inference-max-tokens-per-step", type=int, default=512,
                   help="new tokens per forward (prefill chunks and decodes together)")
    p.add_argument("--inference-max-batch-size", type=int, default=64, help="requests running at once")
    p.add_argument("--inference-max-queued", type=int, default=256,
                   help="requests waiting at most; past it HTTP 429")
    p.add_argument("--drain-timeout", type=float, default=10.0,
                   help="seconds running requests may take to finish after SIGTERM before they are cancelled")
    generate_tool.add_checkpoint_flags(p)
    p.add_argument("--debug", action="store_true", help="show the traceback of a handled error")
    return p


def build_engine(args: argparse.Namespace) -> InferenceEngine:
    """Loads the model at the launch layout (collective) and builds the engine over it."""
    for name in ("inference_max_memory", "inference_max_blocks", "inference_block_size",
                 "inference_max_tokens_per_step", "inference_max_batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    _, metadata = read_metadata(args.load, require_checksums=not args.allow_missing_checksums)
    flags = metadata.get("config") or {}
    tp, pp, ep, etp = generate_tool.launch_layout(args, metadata)
    state = initialize_model_parallel(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    model, _ = load_gpt_from_checkpoint(args.load, state, parallel_output=False,
                                        require_checksums=not args.allow_missing_checksums)
    tokenizer = generate_tool.checkpoint_tokenizer(args, flags)
    max_sequence_length = int(flags.get("seq_length") or 0) or model.config.max_position_embeddings
    num_blocks = args.inference_max_blocks
    if num_blocks is None and args.inference_max_memory is None:
        num_blocks = args.inference_max_batch_size * math.ceil(max_sequence_length / args.inference_block_size)
    return InferenceEngine(model, state, num_blocks=num_blocks, max_memory_bytes=args.inference_max_memory,
                           block_size=args.inference_block_size, max_tokens_per_step=args.inference_max_tokens_per_step,
                           max_batch_size=args.inference_max_batch_size, max_queued=args.inference_max_queued,
                           max_sequence_length=max_sequence_length, tokenizer=tokenizer)


def serve(engine: InferenceEngine, args: argparse.Namespace) -> int:
    """Rank 0: HTTP until SIGTERM / SIGINT (uvicorn's handlers), then the engine's shutdown."""
    import uvicorn

    from megatron_core.inference.engine_loop import EngineLoop
    from megatron_core.inference.server import TextGenerationServer

    loop = EngineLoop(engine)
    name = args.model_name or os.path.basename(os.path.normpath(args.load))
    app = TextGenerationServer(loop, engine.tokenizer, model_name=name, drain_s=args.drain_timeout).app()
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                                           timeout_graceful_shutdown=max(int(math.ceil(args.drain_timeout)), 1)))
    logger.info("serving %s (%d cache blocks of %d tokens) on http://%s:%d", name,
                engine.scheduler.pool.num_blocks, engine.scheduler.pool.block_size, args.host, args.port)
    for sig in (signal.SIGTERM, signal.SIGINT):  # uvicorn re-raises the signal it handled once it has shut
        # down gracefully; with this handler in place (restored by uvicorn) that ends in exit status 0
        signal.signal(sig, lambda number, _frame: logger.info("stopped by signal %d", number))
    try:
        server.run()
    finally:
        loop.shutdown(drain_s=0.0)  # a no-op after the lifespan's; else (startup failed) stops the other ranks
    return 0 if server.started else 1


def _run(argv: Optional[Sequence[str]]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":  # CUDA-only path
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    try:
        engine = build_engine(args)
        if engine.state.rank == 0:
            return serve(engine, args)
        for sig in (signal.SIGTERM, signal.SIGINT):  # rank 0 decides when to stop and tells the others
            signal.signal(sig, lambda number, _frame: logger.info("signal %d: waiting for rank 0 to stop", number))
        engine.follow()
        return 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the server; returns 0 after a clean shutdown, 2 for bad input / 1 for the environment after one
    ``run_text_generation_server.py: error:`` paragraph on stderr (with the traceback under ``--debug``)."""
    return run_tool(PROG, _run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
