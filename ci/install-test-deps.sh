#!/usr/bin/env bash
# Installs everything the self-tests need, CPU only, from PyPI.
#  - torch: an already installed torch is kept; otherwise the CPU-friendly pin below is used.
#  - flashinfer-python and sglang are installed without their dependency sets (CUDA/CUTLASS stacks of several GB);
#    the self-tests only import their pure-Python parts (FlashInfer's CPU quantizer model, SGLang's layer code).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip install -q --disable-pip-version-check"
python -c "import torch" 2>/dev/null || $PIP "torch==2.13.0"
$PIP -e ".[test]"
$PIP --no-deps "flashinfer-python==0.7.4"
$PIP -r ci/requirements-flashinfer-cpu.txt
$PIP --no-deps -r ci/requirements-sglang.txt
$PIP -r ci/requirements-sglang-extra.txt
