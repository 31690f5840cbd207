"""Installs megatron_core (the framework) and kernels (Triton fused ops).

The distribution is named ``megatron-core-3d``: pip treats ``megatron_core`` and NVIDIA's ``megatron-core`` as
the same name (PEP 503 normalization), so installing one would uninstall the other. The import package stays
``megatron_core``; NVIDIA's is ``megatron.core``, and both import side by side.

On a machine without CUDA, install ``torch==2.13.0`` first (scripts/setup.sh does): a CPU build is then
already present and the ``torch`` requirement below is satisfied without pulling a multi-GB CUDA build.
"""
from setuptools import find_packages, setup

setup(
    name="megatron-core-3d",
    version="0.1.0",
    description="Megatron-style 3D-parallel GPT training with ZeRO, testable on CPU",
    packages=find_packages(include=["megatron_core", "megatron_core.*", "kernels", "kernels.*"]),
    # Megatron-LM's pretraining flags (scripts/extract_megatron_flags.py): pretrain_gpt.py recognizes each one.
    package_data={"megatron_core.training": ["megatron_lm_flags.json"],
                  "megatron_core.dryrun": ["fake_cuda_hooks.cpp"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.3",
        # The Triton release the CUDA build of torch 2.13 uses; its interpreter runs the kernels on CPU.
        'triton==3.7.1; platform_system == "Linux"',
        "einops",
        "sentencepiece",
        # GPT-2 byte-level BPE (vocab.json + merges.txt) for --tokenizer-type GPT2BPETokenizer; loads local files.
        "tokenizers",
        "numpy",
        # Checkpoints: tensors without pickle (loading never executes code), memory-mapped partial reads.
        "safetensors",
        # Pictures (loss curve, pipeline timeline, benchmark charts) on matplotlib's Agg canvas: axes, labels
        # and legends that a hand-written PNG encoder did not have.
        "matplotlib",
        # Progress bars of the tools (preprocessing, tokenizer training, conversion, long evaluations).
        "tqdm",
    ],
    extras_require={"test": [
        "pytest>=7",
        # Tests of the Hugging Face GPT-2 import/export (tools/checkpoint_convert.py --loader/--saver hf) compare
        # against transformers' own GPT2LMHeadModel; at runtime only the hf loader/saver import it, lazily.
        # Below 5.25: from 5.25 transformers requires Hugging Face's `kernels` package, whose import name is this
        # repository's kernels/ (transformers then imports ours and fails), and loads hub kernels by default.
        "transformers<5.25",
        # NVIDIA's megatron-core, installed beside us: tests that both import side by side (issue 15, part 6).
        # Light: torch, numpy and packaging only; its wheel runs on CPU.
        "megatron-core==0.16.1",
        # tests/*/test_muon*.py compare our Muon with megatron-core's TensorParallelMuon on NVIDIA's
        # Emerging-Optimizers (scripts/setup.sh installs emerging-optimizers 0.3.0 itself: its wheel declares
        # Python >= 3.12 for typing.override alone), which logs through absl.
        "absl-py",
        # TikTokenizer (tests compare with megatron-core's TikTokenTokenizer); at runtime imported lazily.
        "tiktoken",
        # Lint: scripts/test.sh runs `ruff check .` (ruff.toml) before the tests.
        "ruff",
        # tests/serving start tools/run_text_generation_server.py: its routes and request validation.
        "fastapi",
        # ... and the ASGI server that runs them on a loopback port.
        "uvicorn",
        # tests/serving call that server with the official OpenAI client (completions, chat, streaming).
        "openai",
        # ... and with plain HTTP for Megatron's PUT /api and the bad inputs (openai 3 depends on httpx2, not it).
        "httpx",
    ],
        # tools/run_text_generation_server.py (imported lazily, only by the server): FastAPI for the routes and
        # their validation, uvicorn to serve them.
        "serve": ["fastapi", "uvicorn"],
        # bench_memory.py and benchmark.py also run DeepSpeed's ZeRO engines when deepspeed is installed
        # (pure Python on CPU, gloo); bench_engine.py and tests/engine compare megatron_core.engine with this
        # release (install with DS_BUILD_OPS=0: nothing to compile).
        "bench": ["deepspeed==0.19.8"]},
)
