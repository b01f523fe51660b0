"""vLLM's NVFP4 W4A16 kernel decisions (rules profile vllm-0.32): which linear kernel a W4A16_NVFP4 layer gets per
GPU, --linear-backend, VLLM_BATCH_INVARIANT and humming; which MoE backend per GPU and --moe-backend; what is
refused. Each case is one combination from fixtures/config_rules/vllm_*.json; under another rules profile the
cases skip (that profile does not model vLLM's rules)."""
from __future__ import annotations

import pytest

from conformance._framework.cases import as_params
from conformance.rules.matrix import load_matrix


@pytest.mark.parametrize("case", as_params(load_matrix("vllm_linear")))
def test_vllm_linear_kernel(rules_check, case):
    rules_check(case)


@pytest.mark.parametrize("case", as_params(load_matrix("vllm_moe")))
def test_vllm_moe_backend(rules_check, case):
    rules_check(case)
