#!/usr/bin/env bash
# Multi-node launch: run this on every node with the same MASTER_ADDR (the first node's address), NNODES and
# a distinct NODE_RANK. 8 GPUs per node: tp 8 within a node, pp across nodes, the rest data parallel.
#   MASTER_ADDR=10.0.0.1 NNODES=2 NODE_RANK=0 bash scripts/pretrain_multinode.sh --data-path data/corpus_text_document
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MASTER_ADDR:?set MASTER_ADDR to the first node}" "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}"
torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "${GPUS_PER_NODE:-8}" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" pretrain_gpt.py \
  --tensor-model-parallel-size 8 --pipeline-model-parallel-size "$NNODES" --sequence-parallel \
  --use-distributed-optimizer --overlap-grad-reduce --bf16 \
  --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 \
  --micro-batch-size 1 --global-batch-size 256 --train-iters 10000 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 500 \
  --save ckpt --save-interval 1000 --load ckpt "$@"
