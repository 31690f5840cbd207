#!/usr/bin/env bash
# 3D parallelism on one machine: tensor 2 x pipeline 2 (interleaved, 2 chunks per rank) x data 2 with ZeRO-1,
# sequence parallelism, on 8 processes. Extra flags are passed on, e.g. --data-path PREFIX --save ckpt.
set -euo pipefail
cd "$(dirname "$0")/.."
torchrun --standalone --nproc-per-node 8 pretrain_gpt.py \
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 \
  --sequence-parallel --use-distributed-optimizer --overlap-grad-reduce \
  --num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 \
  --micro-batch-size 2 --global-batch-size 32 --train-iters 200 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 20 \
  --log-interval 10 --eval-interval 100 "$@"
