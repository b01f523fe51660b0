"""The upstream-expectations oracle (fixtures/config_rules/upstream_expectations.json): well-formed, big
enough, every entry sourced; the reference rules agree with every entry under every profile it holds for;
and a disagreement is reported with both sides (the oracle can fail)."""
from __future__ import annotations

import json

import pytest

from conformance.rules.matrix import profile_names
from conformance.rules.oracle import (AGREE, CHECKS, DISAGREE, NOT_APPLICABLE, ORACLE_FILE, SOURCE_FIELDS,
                                        judge, load_expectations, tally)
from conformance.adapters.reference.rules import ReferenceRules
from tests.rules.mutants import DeepEPNormalRejectedOnMain, LmHeadW4A16BranchMissing, PerTokenNotForcedOffUnderW4A16

MIN_EXPECTATIONS = 40


def test_oracle_is_well_formed_and_sourced():
    raw = json.loads(ORACLE_FILE.read_text())["expectations"]
    entries = load_expectations()
    assert len(entries) >= MIN_EXPECTATIONS
    assert len({e.id for e in entries}) == len(entries)
    for e, r in zip(entries, raw):
        assert all(e.source.get(f) for f in SOURCE_FIELDS), e.id
        assert e.source["file"].startswith(("test/", "tests/")), e.id  # written from the engine's own tests
        assert set(e.holds_for) <= set(profile_names()) and e.holds_for, e.id
        assert e.check in CHECKS, e.id
        assert e.expect["kind"] in ("ok", "raises"), e.id
        assert set(r) <= {"id", "area", "source", "holds_for", "check", "inputs", "expect", "note"}, e.id
    assert {e.area for e in entries} >= {"lm_head", "reload", "derived_param", "fp4_backend", "moe_activation",
                                         "quant_method", "mixed_layers"}


@pytest.mark.parametrize("profile", profile_names())
def test_reference_agrees_with_every_expectation_that_holds_for_its_profile(profile):
    engine = ReferenceRules(profile)
    for e in load_expectations():
        verdict, detail = judge(engine, e, profile)
        assert verdict != DISAGREE, detail
        if profile in e.holds_for:
            assert verdict == AGREE, f"{e.id}: {detail}"  # the reference models every check, in every profile
        else:
            assert verdict == NOT_APPLICABLE


def test_counts_per_area_add_up():
    entries = load_expectations()
    counts = tally(ReferenceRules(), "sglang-0.5.23", entries)
    assert counts.pop("_failures") == []
    assert sum(sum(c.values()) for c in counts.values()) == len(entries)
    assert sum(c[AGREE] for c in counts.values()) == sum("sglang-0.5.23" in e.holds_for for e in entries)


@pytest.mark.parametrize("mutant, profile, entry", [
    (LmHeadW4A16BranchMissing, "sglang-0.5.23", "lm_head/accepts_cutedsl_w4a16_runtime_state"),
    (PerTokenNotForcedOffUnderW4A16, "sglang-0.5.23", "moe_activation/nvfp4_online_w4a16_keeps_bf16_activations[none-True]"),
    (DeepEPNormalRejectedOnMain, "sglang-main", "moe/deepep_normal_w4a16_reuses_route_wrapper"),
])
def test_disagreement_is_reported_with_both_sides(mutant, profile, entry):
    (exp,) = [e for e in load_expectations() if e.id == entry]
    verdict, detail = judge(mutant(profile), exp, profile)
    assert verdict == DISAGREE
    assert "upstream:" in detail and "engine:" in detail and exp.source["test"] in detail


def test_unknown_profile_is_an_error_naming_the_known_ones():
    from conformance.rules.matrix import load_matrix, load_profile

    with pytest.raises(ValueError, match="sglang-0.5.23"):
        load_profile("sglang-9.9")
    with pytest.raises(ValueError, match="unknown rules profile"):
        load_matrix("moe")[0].expected_for("sglang-9.9")
    with pytest.raises(ValueError, match="unknown rules profile"):
        ReferenceRules("sglang-9.9")


@pytest.mark.integration
def test_report_names_rules_engine_and_profile(tmp_path):
    """A run with --report-dir records the rules engine (with version) and the profile, in summary.json and
    in report.md; the main-only expectations pass under --rules-profile sglang-main."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "conformance/rules/test_config_rules_upstream.py",
         "-k", "fp4_backend or deepep", "--rules-profile", "sglang-main", "--engine", "reference",
         "--report-dir", str(tmp_path)], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rules"]["profiles"] == ["sglang-main"]
    assert summary["rules"]["engines"] == ["reference (reference_impl, rules profile sglang-main)"]
    assert summary["counts"] == {"passed": 7}
    assert "- Rules engine: reference (reference_impl, rules profile sglang-main); rules profile: sglang-main" in (
        tmp_path / "report.md").read_text()


def test_engine_without_the_optional_methods_reports_them_unsupported():
    """A third-party engine written before the optional methods existed keeps working: those matrices and
    oracle checks are reported unsupported (skipped with the method's name), not failed."""
    from conformance.interfaces.rules import OPTIONAL_METHODS, RulesEngine

    ref = ReferenceRules()
    abstract = {name: (lambda n: lambda self, *a, **k: getattr(ref, n)(*a, **k))(name)
                for name in RulesEngine.__abstractmethods__}
    minimal = type("MinimalEngine", (RulesEngine,), abstract)()
    for matrix, method in OPTIONAL_METHODS.items():
        assert method in (minimal.unsupported(matrix, {}) or ""), matrix
    assert minimal.unsupported("dense", {}) is None
    (exp,) = [e for e in load_expectations() if e.id == "derived_param/alias"]
    verdict, reason = judge(minimal, exp, "sglang-0.5.23")
    assert verdict == NOT_APPLICABLE and "bind_derived_param" in reason
