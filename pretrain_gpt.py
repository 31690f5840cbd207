"""Pretrain a GPT with tensor, pipeline and data (ZeRO) parallelism, using Megatron-LM's flag names.

    python pretrain_gpt.py                                   # a tiny GPT on the built-in corpus, one process
    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 pretrain_gpt.py \\
        --tensor-model-parallel-size 8 --pipeline-model-parallel-size 2 --bf16 --use-distributed-optimizer ...

See ``python pretrain_gpt.py --help`` for every flag, and README.md for the quickstart.
"""
import sys

from megatron_core.training import main

if __name__ == "__main__":
    sys.exit(main())
