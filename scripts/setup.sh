#!/usr/bin/env bash
# Creates .venv and installs megatron_core with its test extra. Safe to run again (it only adds what is
# missing). Without CUDA it installs the CPU build of torch 2.13.0 first, so no multi-GB CUDA build is pulled.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  # On a CPU machine this resolves to the local CPU build; on a CUDA machine to the CUDA build of 2.13.0.
  "${PIP[@]}" torch==2.13.0
fi
"${PIP[@]}" -e '.[test]'
# A venv made before the transformers pin (setup.py) may hold Hugging Face's `kernels` distribution, whose import
# name is this repository's kernels/: remove it (transformers < 5.25 imports it only when it is installed).
"$VENV/bin/python" -m pip uninstall --quiet --yes kernels 2>/dev/null || true
# Emerging-Optimizers (the library megatron-core's Muon is built on; the Muon tests compare with it): its
# wheel says Python >= 3.12, for typing.override only, which the tests backport from typing_extensions.
"$VENV/bin/python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("emerging_optimizers") is None)' \
  || "${PIP[@]}" --no-deps --ignore-requires-python emerging-optimizers==0.3.0
# DeepSpeed itself, which tests/engine compares megatron_core.engine with (losses, lr schedules, config
# parsing). It ships as a source distribution whose setup.py imports torch: built in an isolated environment it
# would pull a second (CUDA) torch, so it builds against the torch above. Pure Python here (no ops are built).
"$VENV/bin/python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("deepspeed") is None)' \
  || { "${PIP[@]}" setuptools wheel && "${PIP[@]}" --no-build-isolation deepspeed==0.19.8; }
"$VENV/bin/python" -c 'import torch, megatron_core; print(f"megatron_core {megatron_core.__version__} with torch {torch.__version__}")'
