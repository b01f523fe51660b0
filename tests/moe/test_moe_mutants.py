"""The MoE checks reject every planted bug (by the named check each mutant declares) and accept every
correct-but-different implementation. Cases come from :mod:`conformance.moe.cases` (CPU tier)."""
from __future__ import annotations

import re

import pytest
import torch

from reference_impl.bounds.dense import ErrorFigures
from conformance.moe.checks import (
    MoERun,
    check_moe_deterministic,
    check_moe_ep_sum,
    check_moe_input_scales_ignored,
    check_moe_output_contract,
    check_moe_prepared_reuse,
    check_moe_summary_figures,
    check_moe_within_bound,
    run_moe_case,
)
from conformance.moe.cases import MOE_CASES, MoECase
from tests.moe.mutants import MUTANTS, VARIANTS, InputScaleFoldedIntoAlpha, KernelLayoutMoE

CPU_CASES = {c.id: c for c in MOE_CASES if c.tier == "cpu"}
#: Small cases that together exercise every mutant's bug: I = 192 (64-row chunks matter), top-2 weights,
#: expert parallel, the last expert hot, untied gate/up scales, a non-gated activation, duplicate and -1 ids,
#: weights that do not sum to 1, activations beyond FP16, EP ranks that own none of a token's experts.
PROBE_CASES = [CPU_CASES[i] for i in (  # cheapest first: a mutant stops at the first case its check rejects
    "t32_e8_k2_x_beyond_fp16", "t32_e8_k2_duplicate_ids", "t32_e8_k2_padding_ids", "t7_e8_k2_h192_i192",
    "t7_e8_k1_ep4_all_to_last", "t128_e8_k2_gate_up_pow2", "t32_e16_k2_rank0_only_ep4", "t128_e8_k2_ep2",
    "t128_e8_k2_relu2", "t128_e64_k8_h256_i128_softmax",
)]
#: Variants must pass everything: small cases covering the 64-row interleave, EP, untied scales, a clamped
#: activation, and the declined general ratio.
VARIANT_CASES = [CPU_CASES[i] for i in (
    "t7_e8_k2_h192_i192", "t7_e8_k1_ep4_all_to_last", "t128_e8_k2_gate_up_pow2", "t128_e8_k2_swiglu_oai",
    "t128_e8_k2_gate_up_general", "t32_e16_k4_duplicate_ids_ep2", "t32_e8_k2_padding_ids",
    "t32_e8_k4_all_slots_one_expert", "t32_e8_k2_x_below_fp16_normal",
)]


def _all_checks(backend, case: MoECase) -> None:
    """Every MoE check the conformance tests run, in their order."""
    run = run_moe_case(backend, case)
    figures = check_moe_within_bound(run)
    check_moe_summary_figures(run, figures)
    check_moe_deterministic(run, backend)
    if case.ep_size > 1:
        check_moe_ep_sum(run)
    check_moe_input_scales_ignored(run, backend)
    check_moe_prepared_reuse(run_moe_case(backend, case), backend)  # last, on its own run


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.__name__)
def test_moe_mutant_is_rejected(mutant) -> None:
    backend = mutant()
    failures = []
    for case in PROBE_CASES:
        if backend.skip_reason(case.info()):
            continue
        try:
            _all_checks(backend, case)
        except AssertionError as exc:
            failures.append((case.id, str(exc)))
            if str(exc).startswith(f"[{mutant.caught_by}]"):
                return
    pytest.fail(f"{mutant.__name__} was not rejected by [{mutant.caught_by}] on any probe case; "
                f"other failures: {[(c, m.splitlines()[0]) for c, m in failures]}")


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.__name__)
@pytest.mark.parametrize("case", VARIANT_CASES, ids=lambda c: c.id)
def test_moe_variant_is_accepted(variant, case: MoECase) -> None:
    backend = variant()
    reason = backend.skip_reason(case.info())
    if reason:
        assert case.gate_up == "general", f"{variant.__name__} declined {case.id}: {reason}"
        return
    from conformance.moe.checks import failing_moe_checks_of_run
    from conformance.moe.diagnosis import diagnose_run

    run = run_moe_case(backend, case)  # every check the conformance tests run, and no diagnosis rule fires
    failures = failing_moe_checks_of_run(run, backend)
    assert not failures and not diagnose_run(run, failures), failures


def test_input_scale_check_catches_folded_alphas_directly() -> None:
    """``moe_input_scales_ignored`` fails on its own (not only through the bound)."""
    backend = InputScaleFoldedIntoAlpha()
    run = run_moe_case(backend, CPU_CASES["t128_e8_k2_ep2"])
    with pytest.raises(AssertionError, match=r"^\[moe_input_scales_ignored\]"):
        check_moe_input_scales_ignored(run, backend)


def test_ep_sum_check_can_fail() -> None:
    """A rank that returns another rank's contribution (counted twice, its own missing) fails the sum."""
    backend = KernelLayoutMoE()
    run = run_moe_case(backend, CPU_CASES["t128_e8_k2_ep2"])
    check_moe_ep_sum(run)
    doctored = MoERun(run.case, run.x, run.topk_ids, run.topk_weights, run.ranks, run.prepared,
                      [run.outputs[0], run.outputs[0]])
    with pytest.raises(AssertionError, match=r"^\[moe_ep_sum\]"):
        check_moe_ep_sum(doctored)


def test_summary_figures_check_can_fail() -> None:
    run = run_moe_case(KernelLayoutMoE(), CPU_CASES["t1_e8_k1_h128_i64"])
    bad = ErrorFigures(0.5, (0, 0), 1.0, 1.0, 1.0, rel_l2=0.05, cosine=0.99)
    with pytest.raises(AssertionError, match=r"^\[moe_summary_figures\]"):
        check_moe_summary_figures(run, bad)


def test_failure_report_names_inputs_and_worst_element() -> None:
    from tests.moe.mutants import RoutingWeightsIgnored

    with pytest.raises(AssertionError) as info:
        check_moe_within_bound(run_moe_case(RoutingWeightsIgnored(), CPU_CASES["t7_e8_k2_h192_i192"]))
    msg = str(info.value)
    assert re.search(r"worst element \(token, column\) \(\d+, \d+\): got .* exact .* bound .* = [0-9.e+]+", msg)
    assert "case MoECase(id='t7_e8_k2_h192_i192'" in msg and "rebuild:" in msg


def test_output_contract_check_accepts_reference_shape() -> None:
    run = run_moe_case(KernelLayoutMoE(), CPU_CASES["t1_e8_k1_h128_i64"])
    check_moe_output_contract(run)
    assert run.outputs[0].dtype == torch.bfloat16


def test_at_real_sizes_summary_figures_reject_what_the_loose_bound_lets_through() -> None:
    """Hidden 4096 / intermediate 1536: the worst-case bound exceeds |y| (see bounds_moe), so a structural
    bug can pass ``moe_within_bound``; FlashInfer's summary thresholds still reject it."""
    from tests.moe.mutants import ActivationOnUpHalf

    case = MoECase("real_size_probe", "cpu", 8, 4, 2, 4096, 1536)
    run = run_moe_case(ActivationOnUpHalf(), case)
    try:
        figures = check_moe_within_bound(run)
    except AssertionError:
        return  # caught by the bound after all: fine
    with pytest.raises(AssertionError, match=r"^\[moe_summary_figures\]"):
        check_moe_summary_figures(run, figures)


# ------------------------------------------------------------------------------------------ diagnosis
DIAGNOSED = [m for m in MUTANTS if m.diagnosed_as]
#: Cheap cases without the features of the cross-case patterns.
_PLAIN = ("t1_e8_k1_h128_i64", "t7_e8_k2_h192_i192", "t128_e8_k2_no_input_scales")


def _names(mutant) -> tuple[str, ...]:
    return (mutant.diagnosed_as,) if isinstance(mutant.diagnosed_as, str) else mutant.diagnosed_as


def test_every_moe_rule_and_pattern_has_a_mutant_or_red_team_backend() -> None:
    from conformance.moe.diagnosis import PATTERNS, RULES
    from tests.moe.test_moe_redteam import MOE_DIAGNOSED

    shown = {n for m in DIAGNOSED for n in _names(m)} | {r for _, _, r in MOE_DIAGNOSED}
    declared = {r.name for r in RULES} | {p.name for p in PATTERNS}
    assert shown <= declared, sorted(shown - declared)
    assert declared <= shown, f"rules/patterns no mutant shows: {sorted(declared - shown)}"


@pytest.mark.parametrize("mutant", DIAGNOSED, ids=lambda m: m.__name__)
def test_moe_mutant_is_diagnosed(mutant) -> None:
    """Each rule a mutant declares fires on a probe case where a check rejects it; each pattern fires across up
    to 3 cpu cases with the pattern's feature and 3 without."""
    from conformance.moe.checks import failing_moe_checks, failing_moe_checks_of_run
    from conformance.moe.diagnosis import PATTERNS, RULES, case_features, diagnose_moe_cases, diagnose_run

    backend = mutant()
    for name in _names(mutant):
        if name in {r.name for r in RULES}:
            seen = {}
            for case in PROBE_CASES:
                if backend.skip_reason(case.info()):
                    continue
                run = run_moe_case(backend, case)
                failures = failing_moe_checks_of_run(run, backend)
                if failures:
                    seen[case.id] = [d.rule for d in diagnose_run(run, failures)]
                    if name in seen[case.id]:
                        break
            else:
                pytest.fail(f"{mutant.__name__}: rule {name!r} fired on no probe case; diagnoses: {seen}")
        else:
            feature = next(p for p in PATTERNS if p.name == name).feature
            having = [c for c in CPU_CASES.values() if feature in case_features(c)
                      and not backend.skip_reason(c.info())][:3]
            cases = having + [CPU_CASES[i] for i in _PLAIN]
            found = {d.rule for d in diagnose_moe_cases([(c, failing_moe_checks(backend, c)) for c in cases])}
            assert name in found, f"{mutant.__name__}: pattern {name!r} not found; found {sorted(found)}"
