"""Self-tests from an independent red team, MoE half (backends written from the adapter interface alone, without
reading tests/moe/mutants.py): every broken fused MoE is rejected by the named check on the case built for its bug
class, and every correct-but-different one passes every check on the cases where it differs from the reference.
The dense half is tests/dense/test_dense_redteam.py.

Kept cheap: each broken backend runs one case; each correct one the few cases its difference shows on (the full
cpu tier for all of them: ``pytest conformance/moe/test_moe.py -m cpu --backend tests.moe.redteam_ok:<Name>``,
docs/moe.md gives the measured figures).
"""
from __future__ import annotations

import pytest

from conformance.moe.cases import MOE_CASES
from conformance.moe.checks import failing_moe_checks

from tests.moe import redteam as M
from tests.moe import redteam_ok as MOK

MOE = {c.id: c for c in MOE_CASES if c.tier == "cpu"}

#: (broken backend, the case built for its bug class, the named check that must reject it there)
MOE_CAUGHT = [
    (M.DuplicatesCountedOnce, "t32_e8_k2_duplicate_ids", "moe_within_bound"),
    (M.DenseMaskScatter, "t32_e8_k4_all_slots_one_expert", "moe_within_bound"),
    (M.NegOneAsExpert0, "t32_e8_k2_padding_ids", "moe_within_bound"),
    (M.NegOneWrapsToLast, "t32_e8_k2_padding_ids", "moe_within_bound"),
    (M.RenormalizedWeights, "t7_e64_k1_h128_i128", "moe_within_bound"),
    (M.EpModuloOwnership, "t7_e8_k1_ep4_all_to_last", "moe_within_bound"),
    (M.EpOffsetMissing, "t128_e8_k2_ep2", "moe_within_bound"),
    (M.InplaceKeepsInputRows, "t32_e16_k2_rank0_only_ep4", "moe_within_bound"),
    (M.StaleWorkspaceRows, "t32_e8_k2_padding_ids", "moe_prepared_reuse"),
    (M.AccumulatingWorkspace, "t1_e8_k1_h128_i64", "moe_deterministic"),
    (M.GateUpSwapped, "t1_e8_k1_h128_i64", "moe_within_bound"),
    (M.RouterWeightOnInput, "t7_e8_k2_h192_i192", "moe_within_bound"),
    (M.Fp16Intermediate, "t32_e8_k2_x_beyond_fp16", "moe_within_bound"),
    (M.Fp16Hidden, "t32_e8_k2_x_below_fp16_normal", "moe_within_bound"),
    (M.Fp16HiddenClamped, "t32_e8_k2_x_beyond_fp16", "moe_within_bound"),
    (M.GateScaleForUp, "t128_e8_k2_gate_up_general", "moe_within_bound"),
    (M.OaiClampMissing, "t128_e8_k2_swiglu_oai", "moe_within_bound"),
]

_ROUTING = ("t32_e8_k2_duplicate_ids", "t64_e16_k4_padding_ids_ep4", "t32_e8_k4_all_slots_one_expert")
MOE_ACCEPTED = [
    (MOK.DenseMaskScatterAdd, _ROUTING),
    (MOK.NegOneMaskedToExpert0, ("t32_e8_k2_padding_ids", "t64_e16_k4_padding_ids_ep4")),
    (MOK.ShuffledExpertOrder, ("t128_e64_k8_ep4",)),
    (MOK.Fp32Intermediate, ("t128_e8_k2_swiglu_oai",)),
    (MOK.Fp64Moe, ("t32_e16_k4_duplicate_ids_ep2",)),
    (MOK.GroupedGemmPadded, ("t32_e8_k2_duplicate_ids", "t32_e16_k2_rank0_only_ep4")),
    (MOK.GeluErf, ("t128_e8_k2_geglu",)),
    (MOK.Bf16ExpertOutputBeforeWeight, ("t32_e8_k4_all_slots_one_expert",)),
]



def test_every_red_team_backend_is_listed() -> None:
    """No broken or correct MoE red-team backend is left out of the self-tests."""
    assert {b for b, _, _ in MOE_CAUGHT} == set(M.BROKEN)
    assert {b for b, _ in MOE_ACCEPTED} <= set(MOK.CORRECT)


@pytest.mark.parametrize("mutant,case_id,check", MOE_CAUGHT, ids=lambda v: getattr(v, "__name__", None))
def test_moe_red_team_mutant_is_caught(mutant, case_id: str, check: str) -> None:
    failures = failing_moe_checks(mutant(), MOE[case_id])
    assert check in failures, f"{mutant.__name__} on {case_id}: [{check}] did not fire; failures: {failures}"


@pytest.mark.parametrize("variant,case_ids", MOE_ACCEPTED, ids=lambda v: getattr(v, "__name__", None))
def test_moe_red_team_variant_is_accepted(variant, case_ids: tuple[str, ...]) -> None:
    """... and no diagnosis rule fires on it."""
    from conformance.moe.checks import failing_moe_checks_of_run, run_moe_case
    from conformance.moe.diagnosis import diagnose_run

    backend = variant()
    for case_id in case_ids:
        run = run_moe_case(backend, MOE[case_id])
        failures = failing_moe_checks_of_run(run, backend)
        assert not failures and not diagnose_run(run, failures), f"{variant.__name__} on {case_id}: {failures}"



# ------------------------------------------------------------------------------------------ diagnosis
#: (broken backend, case, the diagnosis rule its failure there must show)
MOE_DIAGNOSED = [
    (M.StaleWorkspaceRows, "t32_e8_k2_padding_ids", "state_between_calls"),
    (M.GateUpSwapped, "t1_e8_k1_h128_i64", "gate_up_swapped"),
    (M.RenormalizedWeights, "t7_e64_k1_h128_i128", "weights_renormalized"),
    (M.NegOneAsExpert0, "t32_e8_k2_padding_ids", "padding_slots"),
]


@pytest.mark.parametrize("broken,case_id,rule", MOE_DIAGNOSED, ids=lambda v: getattr(v, "__name__", None))
def test_moe_red_team_mutant_is_diagnosed(broken, case_id: str, rule: str) -> None:
    from conformance.moe.checks import failing_moe_checks_of_run, run_moe_case
    from conformance.moe.diagnosis import diagnose_run

    backend = broken()
    run = run_moe_case(backend, MOE[case_id])
    found = [d.rule for d in diagnose_run(run, failing_moe_checks_of_run(run, backend))]
    assert rule in found, f"{broken.__name__} on {case_id}: {found}"
