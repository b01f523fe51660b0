#!/usr/bin/env bash
# The scenario suite against a real vLLM server: vllm-cpu 0.32.0 (a CPU build of vLLM) installed fresh into
# its own virtual environment, serving BF16-dequantized copies of the fixture families (vLLM has no NVFP4
# kernel on CPU; the truth stays the NVFP4 originals'), judged through the `openai` and `vllm` dialects in one
# pytest run (each server serves both), gated by ci/expectations/vllm-cpu-0.32.toml: the run passes exactly
# when vLLM behaves as recorded there (an unexpected failure, a failure for another reason than recorded, an
# unexpected pass of a strict entry, or a stale entry fails it; a `strict = false` entry's pass is an XPASS).
#
#   bash ci/vllm_cpu_server.sh                 # fresh venv in a temporary directory, removed afterwards
#   bash ci/vllm_cpu_server.sh --venv DIR      # install into DIR (kept); an existing DIR with vllm-cpu is reused
#   bash ci/vllm_cpu_server.sh --venv DIR --install-only   # only the install (.ci/run overlaps it with the
#                                                           # self-tests: it is mostly download time)
#   bash ci/vllm_cpu_server.sh --venv DIR --junitxml FILE   # also write the scenario run's JUnit report
#                                                           # (ci/stress.py compares per-test outcomes)
#
# What a working vllm-cpu needs (each step below fails the run with its reason, never a silent skip):
# - its dependencies pinned by ci/constraints-vllm-cpu.txt (a working install's pip freeze);
# - torch 2.13.0 (CPU build) installed first: vllm-cpu pins torch==2.13.0+cpu, an unpinned resolve pulls CUDA;
# - torchvision, torchaudio, torchcodec removed: vllm-cpu's metadata pulls them from the registry, and their
#   builds do not match this torch (`import vllm` dies: "operator torchvision::nms does not exist");
# - `python -m vllm.entrypoints.openai.api_server` (`vllm serve` fails in that package);
# - the CPU's AMX tile permission requested in every process (Linux grants AMX per process, on request):
#   a sitecustomize.py in the venv calls torch.cpu._init_amx() (a no-op where the CPU has no AMX);
# - no --enable-sleep-mode (refused on CPU: "Sleep mode is not supported on current platform"); vLLM's CPU
#   worker then keeps its weights through /sleep, which the scenarios do not depend on (they reload after it).
# Thread counts stay modest (OMP_NUM_THREADS=1 per vLLM process; the KV cache 1 GiB); servers start one at a
# time (-n 0) and are stopped at the end of the run.
set -uo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
EXPECTATIONS=ci/expectations/vllm-cpu-0.32.toml

VENV=""
INSTALL_ONLY=0
JUNIT=()
USAGE="usage: $0 [--venv DIR] [--install-only] [--junitxml FILE]"
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) [ $# -ge 2 ] || { echo "$USAGE" >&2; exit 2; }; VENV=$2; shift 2 ;;
    --install-only) INSTALL_ONLY=1; shift ;;
    --junitxml) [ $# -ge 2 ] || { echo "$USAGE" >&2; exit 2; }; JUNIT=("--junitxml=$2"); shift 2 ;;
    *) echo "$USAGE" >&2; exit 2 ;;
  esac
done
[ "$INSTALL_ONLY" -eq 0 ] || [ -n "$VENV" ] || { echo "$0: --install-only needs --venv DIR (else the venv is removed)" >&2; exit 2; }
WORK=$(mktemp -d "${TMPDIR:-/tmp}/nvfp4-vllm-cpu-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
[ -n "$VENV" ] || VENV=$WORK/venv

fail() { echo "vllm-cpu stage: $*" >&2; exit 1; }
now() { date +%s.%N; }
PIP=("$VENV/bin/python" -m pip install -q --no-cache-dir --disable-pip-version-check)
# pip byte-compiles every installed file, serially (most of the install's CPU); where Python may write compiled
# modules the first vLLM process compiles what it imports instead (a third of them), and later ones reuse it.
# Under PYTHONDONTWRITEBYTECODE every process would compile again: then pip does it once.
[ -z "${PYTHONDONTWRITEBYTECODE:-}" ] && PIP+=(--no-compile)

t0=$(now)
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vllm-cpu stage: reusing $VENV"
else
  python -m venv "$VENV" || fail "cannot create a virtual environment at $VENV (python -m venv)"
  "${PIP[@]}" "torch==$TORCH_VERSION" > "$WORK/pip-torch.log" 2>&1 \
    || { tail -20 "$WORK/pip-torch.log" >&2; fail "pip install torch==$TORCH_VERSION failed (above)"; }
  "${PIP[@]}" -c ci/constraints-vllm-cpu.txt "vllm-cpu==$VLLM_CPU_VERSION" > "$WORK/pip-vllm.log" 2>&1 \
    || { grep -v "^WARNING: Location" "$WORK/pip-vllm.log" | tail -30 >&2;
         fail "pip install vllm-cpu==$VLLM_CPU_VERSION failed (above): vllm-cpu cannot be installed here"; }
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec > "$WORK/pip-uninstall.log" 2>&1 \
    || { tail -10 "$WORK/pip-uninstall.log" >&2; fail "removing torchvision/torchaudio/torchcodec failed (above)"; }
fi
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") \
  || fail "cannot locate the venv's site-packages"
cat > "$site/sitecustomize.py" <<'EOF'
# Written by ci/vllm_cpu_server.sh: vLLM's CPU kernels (oneDNN, cpu_attn) use AMX tiles where the CPU has
# them, and Linux lets a process use them only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM). Every process
# of this environment asks at start-up, so vLLM's engine-core and worker processes do too.
try:
    import torch

    torch.cpu._init_amx()
except Exception as exc:  # noqa: BLE001 - the server's own start-up will say what is wrong
    import sys

    print(f"sitecustomize: torch.cpu._init_amx() failed: {exc!r}", file=sys.stderr)
EOF
versions=$("$VENV/bin/python" - <<'EOF'
import importlib.metadata as md, importlib.util
import torch, vllm
assert not any(importlib.util.find_spec(m) for m in ("torchvision", "torchaudio", "torchcodec")), "torchvision & co. still installed"
print(f"vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__}, transformers {md.version('transformers')}")
EOF
) || fail "the installed vllm-cpu does not import (above)"
t1=$(now)
install_s=$(python -c "print(f'{$t1 - $t0:.0f}')")
echo "vllm-cpu stage: installed in ${install_s} s: $versions"
[ "$INSTALL_ONLY" -eq 1 ] && exit 0

SERVER_CMD="$VENV/bin/python -m vllm.entrypoints.openai.api_server --model {model_path} --port {port} \
--host 127.0.0.1 --tensor-parallel-size {tp} --max-model-len 256 --dtype bfloat16 --enforce-eager"
# TP2 (its one scenario, tp_agreement, on the dense family) beside TP1 (every scenario, both families, and the
# quick workload: every prompt position and generated token judged, prompt logprobs through both dialects)
SELECT="cpu-tp1 or (cpu-tp2 and dense and tp_agreement)"
# nobind: vLLM's automatic thread binding wants one NUMA node per TP rank (refused at TP2 on one node)
# vLLM leaves sockets, distributed-init files and lock files in the temporary directory: give it one that goes
# with $WORK (the failure messages quote the server logs, which live there too)
mkdir -p "$WORK/tmp" && export TMPDIR="$WORK/tmp"
export VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 \
  VLLM_CACHE_ROOT="$WORK/vllm-cache" VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1
python -m pytest conformance/server/test_server_scenarios.py -p no:cacheprovider -n 0 -rA \
  --server-api openai,vllm --server-weights bf16 --server-configs cpu-tp1,cpu-tp2 -k "$SELECT" --workload quick \
  --server-cmd "$SERVER_CMD" --server-start-timeout 600 --expectations "$EXPECTATIONS" "${JUNIT[@]}"
rc=$?
t2=$(now)
python -c "print(f'vllm-cpu stage: install {$t1 - $t0:.0f} s, scenario run {$t2 - $t1:.0f} s, pytest exit {$rc}')"
[ "$rc" -eq 5 ] && { echo "vllm-cpu stage: pytest collected no tests: failing" >&2; exit 1; }
exit "$rc"
