"""Self-tests from an independent red team, dense half (backends written from the adapter interface alone, without
reading tests/dense/mutants.py): every broken backend is rejected by the named check on the case built for its bug class, and
every correct-but-different backend passes every check on the cases where it differs from the reference.

Kept cheap: each broken backend runs one case; each correct one the few cases its difference shows on (the full
cpu tier for all of them: ``pytest conformance/dense/test_dense.py -m cpu --backend tests.dense.redteam_ok:<Name>``,
docs/dense.md gives the measured figures). The MoE half is tests/moe/test_moe_redteam.py.
"""
from __future__ import annotations

import pytest

from conformance.dense.checks import STRICT_CHECKS, failing_checks
from conformance.dense.cases import CPU_CASES

from tests.dense import redteam as D
from tests.dense import redteam_ok as DOK

DENSE = {c.id: c for c in CPU_CASES}
STRICT_1P5 = "cpu-alpha-1p5-pow2-m128-n160-k256"  # alpha = 1.5 * 2^e: the alpha multiply rounds

#: (broken backend, the case built for its bug class, the named check that must reject it there)
DENSE_CAUGHT = [
    (D.Fp16WholeTensor, "cpu-x-beyond-fp16", "check_within_error_bound"),
    (D.Fp16InsideGemm, "cpu-x-below-fp16-normal", "check_within_error_bound"),
    (D.Fp16Clamped, "cpu-x-beyond-fp16", "check_within_error_bound"),
    (D.Fp16FlushSubnormals, "cpu-x-below-fp16-normal", "check_within_error_bound"),
    (D.Fp16OutputOnly, "cpu-x-mixed-magnitudes", "check_within_error_bound"),
    (D.Fp16Accumulation, "cpu-x-channel-outliers-awq", "check_within_error_bound"),
    (D.Bf16SplitK, STRICT_1P5, "check_correctly_rounded"),
    (D.Bf16SplitK4, "cpu-pow2-alpha-3d-noncontiguous", "check_correctly_rounded"),
    (D.Bf16SplitK8, "cpu-pow2-alpha-m128-n160-k256", "check_correctly_rounded"),
    (D.Bf16SplitKReducedInBf16, "cpu-pow2-alpha-m128-n160-k256", "check_correctly_rounded"),
    (D.TruncatingOutput, "cpu-pow2-alpha-m128-n160-k256", "check_rounding_direction"),
    (D.FloorOutput, "cpu-pow2-alpha-m128-n160-k256", "check_correctly_rounded"),
    (D.RoundBeforeAlpha, STRICT_1P5, "check_correctly_rounded"),
    (D.NibbleOrderOddBlocks, "cpu-m7-n160-k256", "check_within_error_bound"),
    (D.LastBlockScaleFromPrevious, "cpu-k48-mult16-not64", "check_within_error_bound"),
    (D.PartialScaleGroupZero, "cpu-k80-mult16-not64", "check_within_error_bound"),
    (D.Ws2MinAcrossShards, "cpu-fused-qkv-3-scales", "check_within_error_bound"),
    (D.Ws2PerShard, "cpu-fused-qkv-3-scales", "check_within_error_bound"),
    (D.ScalesAsUE4M3Fnuz, "cpu-m7-n160-k256", "check_within_error_bound"),
    (D.StridesIgnored, "cpu-noncontiguous", "check_within_error_bound"),
    (D.AwqDivided, "cpu-awq", "check_within_error_bound"),
]

#: (correct backend, the cases its difference shows on)
DENSE_ACCEPTED = [
    (DOK.Pairwise, ("cpu-pow2-alpha-m128-n160-k256", "cpu-pow2-alpha-nonneg-m64-n128-k1024", STRICT_1P5)),
    (DOK.TensorCoreRTZ32, ("cpu-pow2-alpha-nonneg-m64-n128-k1024", STRICT_1P5)),
    (DOK.AlphaFoldedIntoScales, (STRICT_1P5, "cpu-fused-qkv-3-scales", "cpu-x-mixed-magnitudes", "cpu-e4m3-subnormal")),
    (DOK.AwqBf16Prescale, ("cpu-awq-bias-3d", "cpu-x-channel-outliers-awq")),
    (DOK.BiasAfterBf16Rounding, ("cpu-bias", "cpu-awq-bias-3d", "cpu-nonfinite-3d-bias")),
]


def test_every_red_team_backend_is_listed() -> None:
    """No broken or correct dense red-team backend is left out of the self-tests."""
    assert {b for b, _, _ in DENSE_CAUGHT} == set(D.BROKEN)
    assert {b for b, _ in DENSE_ACCEPTED} <= set(DOK.CORRECT)


@pytest.mark.parametrize("mutant,case_id,check", DENSE_CAUGHT, ids=lambda v: getattr(v, "__name__", None))
def test_dense_red_team_mutant_is_caught(mutant, case_id: str, check: str) -> None:
    failures = failing_checks(mutant(), DENSE[case_id])
    assert check in failures, f"{mutant.__name__} on {case_id}: {check} did not fire; failures: {failures}"


@pytest.mark.parametrize("variant,case_ids", DENSE_ACCEPTED, ids=lambda v: getattr(v, "__name__", None))
def test_dense_red_team_variant_is_accepted(variant, case_ids: tuple[str, ...]) -> None:
    """... and no diagnosis rule fires on it (they need a failing check)."""
    from conformance.dense.checks import failing_checks_of_run, run_dense_case
    from conformance.dense.diagnosis import diagnose_run

    backend = variant()
    for case_id in case_ids:
        run = run_dense_case(backend, DENSE[case_id])
        failures = failing_checks_of_run(run, backend)
        assert not failures and not diagnose_run(run, failures), f"{variant.__name__} on {case_id}: {failures}"


def test_double_rounding_within_the_bound_is_flagged_by_the_strict_checks_only() -> None:
    """alpha applied to the activations in BF16: correct under the error bound (every non-strict check passes, also
    with AWQ and a bias), but a second rounding, which only the strict single-rounding checks reject (docs/dense.md:
    an expectation file may accept them for such a backend)."""
    variant = DOK.AlphaOnActivationsBf16()
    assert not failing_checks(variant, DENSE["cpu-awq-bias-3d"])
    flagged = failing_checks(variant, DENSE[STRICT_1P5])
    assert "check_correctly_rounded" in flagged and set(flagged) <= set(STRICT_CHECKS), flagged


# ------------------------------------------------------------------------------------------ diagnosis
#: (broken backend, case, the diagnosis rule its failure there must show)
DENSE_DIAGNOSED = [
    (D.Ws2MinAcrossShards, "cpu-fused-qkv-3-scales", "min_shard_scale"),
    (D.Ws2PerShard, "cpu-fused-qkv-3-scales", "per_shard_scale"),
    (D.Bf16SplitK, STRICT_1P5, "bf16_partial_sums"),
    (D.TruncatingOutput, "cpu-pow2-alpha-m128-n160-k256", "truncating_conversion"),
    (D.AwqDivided, "cpu-awq", "pre_quant_scale_inverted"),
]
#: (broken backend, the cross-case pattern its failures over the cpu tier must show)
DENSE_PATTERNS = [(D.StridesIgnored, "noncontiguous_only")]


@pytest.mark.parametrize("broken,case_id,rule", DENSE_DIAGNOSED, ids=lambda v: getattr(v, "__name__", None))
def test_dense_red_team_mutant_is_diagnosed(broken, case_id: str, rule: str) -> None:
    from conformance.dense.checks import failing_checks_of_run, run_dense_case
    from conformance.dense.diagnosis import diagnose_run

    backend = broken()
    run = run_dense_case(backend, DENSE[case_id])
    found = [d.rule for d in diagnose_run(run, failing_checks_of_run(run, backend))]
    assert rule in found, f"{broken.__name__} on {case_id}: {found}"


@pytest.mark.parametrize("broken,pattern", DENSE_PATTERNS, ids=lambda v: getattr(v, "__name__", None))
def test_dense_red_team_pattern(broken, pattern: str) -> None:
    from conformance.dense.diagnosis import diagnose_dense_cases

    from tests.dense.mutants import pattern_probe_cases

    backend = broken()
    found = {d.rule for d in diagnose_dense_cases([(c, failing_checks(backend, c)) for c in pattern_probe_cases(pattern)])}
    assert pattern in found, f"{broken.__name__}: {sorted(found)}"
