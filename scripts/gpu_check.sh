#!/usr/bin/env bash
# One-GPU check (under 8 minutes on an H100/H200): Triton kernels against torch (fp32/bf16, GPT and odd shapes),
# their bandwidth against the device's peak, and a 1-GPU bf16 training run of a ~1.3B GPT reporting MFU.
# The compact summary is printed and written to outputs/gpu_check_<time>.txt (+ .json).
#
#   bash scripts/gpu_check.sh                     # on the GPU machine
#   bash scripts/gpu_check.sh --dry-run           # anywhere: tiny shapes, CPU, Triton interpreter (plumbing only)
#   bash scripts/gpu_check.sh --skip-compile-run  # train eager only
#
# PYTHON picks the interpreter (default: .venv/bin/python of the repository when present, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/megatron_core_inductor_$(id -u)}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-${TMPDIR:-/tmp}/megatron_core_triton_$(id -u)}"
for arg in "$@"; do
  if [[ "$arg" == "--dry-run" ]]; then export TRITON_INTERPRET=1; fi
done
exec timeout --signal=INT --kill-after=20 480 "$PYTHON" scripts/gpu_check.py "$@"
