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
# One test (one SGLang import, ~40 s on a loaded 2-core host, in one xdist worker). The full unpatched run is
# the conformance suite's job: pytest conformance/test_config_rules.py ... --engine sglang.

def _always_rebind(module, name, new_value):
    import torch

    setattr(module, name, torch.nn.Parameter(new_value.detach().clone(), requires_grad=False))


def test_sglang_engine_runs_sglang_code():
    from conformance.engines import EngineUnavailable, load_engine

    try:
        engine = load_engine("sglang")
    except EngineUnavailable as exc:
        pytest.skip(f"sglang engine unavailable: {exc}")
    fu = engine.fu
    breakages = [  # (module, attribute, broken version, matrix, a case that must now fail)
        (engine.common, "copy_or_rebind_param", _always_rebind, "reload", "parameter-new=same-captured=no"),
        (engine.logits, "should_apply_lm_head_quant_method", lambda head, method: True, "lm_head",
         "method=nvfp4_w4a16-head=dense_bf16"),
        (engine.hook, "handle_a2a_moe", lambda server_args: None, "a2a",
         "flashinfer-w4a16=1-nvfp4_dispatch=1-type=none-flashinfer_cutedsl-modelopt_fp4"),
        (engine.mq, "get_fp4_gemm_runner_backend", lambda: fu.Fp4GemmRunnerBackend.FLASHINFER_CUTEDSL, "dense",
         "w4a16=1-flashinfer_cutlass-cpu-NVFP4"),
    ]
    for module, attr, broken, matrix, case_id in breakages:
        (case,) = [c for c in load_matrix(matrix) if c.id == case_id]
        assert mismatch(case, run_case(engine, case)) is None, f"unpatched SGLang fails {matrix}[{case_id}]"
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(module, attr, broken)
            assert mismatch(case, run_case(engine, case)) is not None, (
                f"patching {module.__name__}.{attr} did not change {matrix}[{case_id}]: the adapter is not calling it")
