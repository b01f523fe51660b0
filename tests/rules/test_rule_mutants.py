"""Every rule check can fail: each mutant engine is rejected by a named case; correct variants pass; and
the sglang engine really runs SGLang (a monkeypatched, broken SGLang function is caught)."""
from __future__ import annotations

import pytest

from conformance.rules.matrix import DEFAULT_PROFILE, MATRICES, load_matrix, mismatch, profile_names, run_case
from conformance.adapters.reference.rules import ReferenceRules
from tests.helpers import built_as_w4a4
from tests.rules.mutants import ACCEPTED_VARIANTS, MUTANTS, PROFILE_MUTANTS
from tests.rules.redteam import REDTEAM_MUTANTS

ALL_MUTANTS = {**MUTANTS, **REDTEAM_MUTANTS}


def _failures(engine, matrix: str, profile: str = DEFAULT_PROFILE) -> dict[str, str]:
    engine.use_profile(profile)
    failures = {}
    for case in load_matrix(matrix):
        if engine.unsupported(matrix, case.inputs):
            continue
        problem = mismatch(case, run_case(engine, case), profile)
        if problem:
            failures[case.id] = problem
    return failures


@pytest.mark.parametrize("mutant", list(ALL_MUTANTS), ids=lambda m: m.name)
def test_mutant_is_caught(mutant):
    matrix, catching_case = ALL_MUTANTS[mutant]
    failures = _failures(mutant(), matrix)
    assert catching_case in failures, (
        f"{mutant.name} not caught by {matrix}[{catching_case}]; failing cases: {sorted(failures)[:5]}")
    assert "expected" in failures[catching_case] and "inputs" in failures[catching_case]


@pytest.mark.parametrize("mutant", list(PROFILE_MUTANTS), ids=lambda m: m.name)
def test_profile_mutant_is_caught_by_its_profile(mutant):
    """A mutant that keeps the 0.5.23 rule where main changed it: caught under sglang-main, and (being the
    0.5.23 rule) not caught under sglang-0.5.23 on that case."""
    profile, matrix, catching_case = PROFILE_MUTANTS[mutant]
    failures = _failures(mutant(), matrix, profile)
    assert catching_case in failures, f"{mutant.name} not caught by {matrix}[{catching_case}] under {profile}"
    assert catching_case not in _failures(mutant(), matrix, DEFAULT_PROFILE)


def _modelled(matrix: str, profile: str) -> bool:
    """Whether ``profile`` has expected outcomes for ``matrix`` (the vLLM matrices belong to vllm-0.32 only, and
    vllm-0.32 models only them)."""
    return all(case.not_modelled(profile) is None for case in load_matrix(matrix))


@pytest.mark.parametrize("matrix,profile", [(m, p) for p in profile_names() for m in MATRICES if _modelled(m, p)])
def test_reference_passes_every_matrix(matrix, profile):
    assert _failures(ReferenceRules(), matrix, profile) == {}


def test_profiles_differ_exactly_on_their_overrides():
    """The 0.5.23 reference judged by sglang-main fails exactly the cases main overrides (and vice versa):
    a profile changes outcomes only where its sources say the rule changed."""
    from conformance.rules.matrix import load_profile

    overrides = load_profile("sglang-main")["overrides"]
    assert overrides, "sglang-main overrides nothing"
    for matrix in [m for m in MATRICES if _modelled(m, DEFAULT_PROFILE) and _modelled(m, "sglang-main")]:
        want = set(overrides.get(matrix, {}))
        assert set(_failures(_Pinned(DEFAULT_PROFILE), matrix, "sglang-main")) == want, matrix
        assert set(_failures(_Pinned("sglang-main"), matrix, DEFAULT_PROFILE)) == want, matrix


class _Pinned(ReferenceRules):
    """A reference engine that keeps its profile whatever it is told (as a real engine of one version does)."""

    def use_profile(self, profile: str) -> None:
        pass


@pytest.mark.parametrize("variant", ACCEPTED_VARIANTS, ids=lambda v: v.name)
def test_correct_variant_is_accepted(variant):
    for matrix in [m for m in MATRICES if _modelled(m, DEFAULT_PROFILE)]:
        assert _failures(variant(), matrix) == {}, matrix


# ---- the sglang engine calls SGLang's own code ---------------------------------------------------------------
# One test (one SGLang import, ~40 s on a loaded 2-core host, in one xdist worker). The full unpatched run is
# the conformance suite's job: pytest conformance/rules/test_config_rules.py ... --engine sglang.

def _always_rebind(module, name, new_value):
    import torch

    setattr(module, name, torch.nn.Parameter(new_value.detach().clone(), requires_grad=False))


def test_sglang_engine_runs_sglang_code():
    from conformance.rules import EngineUnavailable, load_rules_engine

    try:
        engine = load_rules_engine("sglang")
    except EngineUnavailable as exc:
        pytest.skip(f"sglang engine unavailable: {exc}")
    fu = engine.fu
    from conformance.adapters.sglang._import import import_sglang_module

    model_config = import_sglang_module("sglang.srt.configs.model_config")
    breakages = [  # (module, attribute, broken version, matrix, a case that must now fail)
        (engine.common, "copy_or_rebind_param", _always_rebind, "reload", "parameter-new=same-captured=no"),
        (engine.logits, "should_apply_lm_head_quant_method", lambda head, method: True, "lm_head",
         "method=nvfp4_w4a16-head=dense_bf16"),
        (engine.hook, "handle_a2a_moe", lambda server_args: None, "a2a",
         "flashinfer-w4a16=1-nvfp4_dispatch=1-type=none-flashinfer_cutedsl-modelopt_fp4"),
        (engine.mq, "get_fp4_gemm_runner_backend", lambda: fu.Fp4GemmRunnerBackend.FLASHINFER_CUTEDSL, "dense",
         "w4a16=1-flashinfer_cutlass-cpu-NVFP4"),
        # The recapture guard: a refresh without it (copies what fits, rebinds the rest) must fail the case.
        (engine.cutedsl, "refresh_cutedsl_standard_scales_for_weight_update", _refresh_without_guard, "reload",
         "parameter-new=shape-captured=yes"),
        (engine.common, "alias_or_bind_derived_param", lambda m, s, d, v: engine.common.copy_or_rebind_param(m, d, v),
         "derived_param", "parameter-broadcast_row-before=absent"),
        (fu, "initialize_fp4_gemm_config", _always_cutlass(fu), "fp4_backend", "auto-sm100"),
        (engine.cutedsl, "ensure_cutedsl_wrapper", built_as_w4a4(engine.cutedsl.ensure_cutedsl_wrapper), "moe_activation",
         "nvfp4_online-w4a16=1-per_token=0-none"),
        (engine.mq, "should_use_flashinfer_cutlass_moe_fp4_allgather", lambda: False, "fp4_dispatch",
         "runner=flashinfer_cutlass-a2a=none-w4a16=0-nvfp4_dispatch=0-dp_attention=on-per_token=0"),
        (model_config.ModelConfig, "_parse_modelopt_quant_config", lambda self, d: None, "quant_method",
         "NVFP4-hf_quant_config"),
        (engine.mq.ModelOptMixedPrecisionConfig, "_quantized_layer_prefix_candidates", staticmethod(lambda p: (p,)),
         "mixed_layers", "vl-W4A16_NVFP4-shared_gate_up_proj"),
        # SGLang's own env parsing is what env_flags exercises: a parser taking any word but "0" for true fails.
        (import_sglang_module("sglang.srt.environ").EnvBool, "parse", lambda self, value: value != "0",
         "env_flags", "w4a16_dense=false"),
    ]
    for module, attr, broken, matrix, case_id in breakages:
        (case,) = [c for c in load_matrix(matrix) if c.id == case_id]
        assert mismatch(case, run_case(engine, case)) is None, f"unpatched SGLang fails {matrix}[{case_id}]"
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(module, attr, broken)
            assert mismatch(case, run_case(engine, case)) is not None, (
                f"patching {module.__name__}.{attr} did not change {matrix}[{case_id}]: the adapter is not calling it")


def _refresh_without_guard(layer):
    """SGLang's CuTe DSL scale refresh minus its recapture guard: copies what fits, rebinds what does not."""
    from conformance.adapters.sglang._import import import_sglang_module

    cutedsl = import_sglang_module("sglang.srt.layers.moe.moe_runner.flashinfer_cutedsl")
    w1_alpha, fc2, w2_alpha, _ = cutedsl.resolve_cutedsl_standard_scales(layer)
    for current, value in zip(layer._cutedsl_scales, (w1_alpha, fc2, w2_alpha)):
        if current.shape == value.shape and current.dtype == value.dtype:
            current.data.copy_(value)
        else:
            current.data = value


def _always_cutlass(fu):
    def initialize():
        fu.FP4_GEMM_RUNNER_BACKEND = fu.Fp4GemmRunnerBackend.FLASHINFER_CUTLASS
    return initialize
