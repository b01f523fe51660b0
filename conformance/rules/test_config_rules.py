"""docs/contracts.md section 4: dense quant-mode resolution, FP4 GEMM dispatch and backend choice, MoE mode, A2A/dispatch
validation, fusion guards, the CuTe DSL MoE runner's activation path (serialized and online NVFP4), the FP4
dispatch decision, and which quantization method / per-module format a checkpoint's config selects. Each case
is one combination from fixtures/config_rules/<matrix>.json, judged by the rules profile (--rules-profile)."""
from __future__ import annotations

import pytest

from conformance._framework.cases import as_params
from conformance.rules.matrix import load_matrix


@pytest.mark.parametrize("case", as_params(load_matrix("dense")))
def test_dense(rules_check, case):
    rules_check(case)


@pytest.mark.parametrize("case", as_params(load_matrix("fp4_gemm")))
def test_fp4_gemm(rules_check, case):
    rules_check(case)


@pytest.mark.parametrize("case", as_params(load_matrix("fp4_backend")))
def test_fp4_backend(rules_check, case):
    rules_check(case)


@pytest.mark.parametrize("case", as_params(load_matrix("moe")))
def test_moe(rules_check, case):
    rules_check(case)


@pytest.mark.parametrize("case", as_params(load_matrix("a2a")))
def test_a2a(rules_check, case):
    rules_check(case)


@pytest.mark.parametrize("case", as_params(load_matrix("fusion")))
def test_fusion(rules_check, case):
    rules_check(case)


@pytest.mark.parametrize("case", as_params(load_matrix("moe_activation")))
def test_moe_activation(rules_check, case):
    rules_check(case)


@pytest.mark.parametrize("case", as_params(load_matrix("fp4_dispatch")))
def test_fp4_dispatch(rules_check, case):
    rules_check(case)


@pytest.mark.parametrize("case", as_params(load_matrix("quant_method")))
def test_quant_method(rules_check, case):
    rules_check(case)


@pytest.mark.parametrize("case", as_params(load_matrix("mixed_layers")))
def test_mixed_layers(rules_check, case):
    rules_check(case)


@pytest.mark.parametrize("case", as_params(load_matrix("env_flags")))
def test_env_flags(rules_check, case):
    """Each boolean env flag in SGLang's spellings (true/yes/y/1, false/no/n/0, any case) and one invalid
    word (SGLang warns and keeps the default): a parser that takes "false" for true, or only "1", fails."""
    rules_check(case)
