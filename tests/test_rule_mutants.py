"""Every rule check can fail: each mutant engine is rejected by a named case; correct variants pass; and
the sglang engine really runs SGLang (a monkeypatched, broken SGLang function is caught)."""
from __future__ import annotations

import pytest

from conformance.engines.matrix import MATRICES, load_matrix, mismatch, run_case
from conformance.engines.reference import ReferenceRules
from tests.mutants.rules import ACCEPTED_VARIANTS, MUTANTS


def _failures(engine, matrix: str) -> dict[str, str]:
    failures = {}
    for case in load_matrix(matrix):
        if engine.unsupported(matrix, case.inputs):
            continue
        problem = mismatch(case, run_case(engine, case))
        if problem:
            failures[case.id] = problem
    return failures


@pytest.mark.parametrize("mutant", list(MUTANTS), ids=lambda m: m.name)
def test_mutant_is_caught(mutant):
    matrix, catching_case = MUTANTS[mutant]
    failures = _failures(mutant(), matrix)
    assert catching_case in failures, (
        f"{mutant.name} not caught by {matrix}[{catching_case}]; failing cases: {sorted(failures)[:5]}")
    assert "expected" in failures[catching_case] and "inputs" in failures[catching_case]


@pytest.mark.parametrize("matrix", MATRICES)
def test_reference_passes_every_matrix(matrix):
    assert _failures(ReferenceRules(), matrix) == {}


@pytest.mark.parametrize("variant", ACCEPTED_VARIANTS, ids=lambda v: v.name)
def test_correct_variant_is_accepted(variant):
    for matrix in MATRICES:
        assert _failures(variant(), matrix) == {}, matrix


# ---- the sglang engine calls SGLang's own code ---------------------------------------------------------------

@pytest.fixture(scope="module")
def sglang_engine():
    from conformance.engines import EngineUnavailable, load_engine

    try:
        return load_engine("sglang")
    except EngineUnavailable as exc:
        pytest.skip(f"sglang engine unavailable: {exc}")


def test_sglang_engine_sees_patched_copy_or_rebind(sglang_engine, monkeypatch):
    def always_rebind(module, name, new_value):
        import torch

        setattr(module, name, torch.nn.Parameter(new_value.detach().clone(), requires_grad=False))

    monkeypatch.setattr(sglang_engine.common, "copy_or_rebind_param", always_rebind)
    assert "parameter-new=same-captured=no" in _failures(sglang_engine, "reload")


def test_sglang_engine_sees_patched_lm_head_guard(sglang_engine, monkeypatch):
    monkeypatch.setattr(sglang_engine.logits, "should_apply_lm_head_quant_method", lambda head, method: True)
    assert "method=nvfp4_w4a16-head=dense_bf16" in _failures(sglang_engine, "lm_head")


def test_sglang_engine_sees_patched_a2a_hook(sglang_engine, monkeypatch):
    monkeypatch.setattr(sglang_engine.hook, "handle_a2a_moe", lambda server_args: None)
    failures = _failures(sglang_engine, "a2a")
    assert "flashinfer-w4a16=1-nvfp4_dispatch=1-type=none-flashinfer_cutedsl-modelopt_fp4" in failures


def test_sglang_engine_sees_patched_quant_mode_source(sglang_engine, monkeypatch):
    # Make SGLang's FP4 backend query lie: the dense resolution must follow it.
    mq = sglang_engine.mq
    fu = sglang_engine.fu
    monkeypatch.setattr(mq, "get_fp4_gemm_runner_backend", lambda: fu.Fp4GemmRunnerBackend.FLASHINFER_CUTEDSL)
    assert "w4a16=1-flashinfer_cutlass-cpu-NVFP4" in _failures(sglang_engine, "dense")


def test_sglang_engine_passes_unpatched(sglang_engine):
    for matrix in MATRICES:
        assert _failures(sglang_engine, matrix) == {}, matrix
