"""The dense checks can fail: every mutant is rejected by its named check on some cpu case, every correct
variant passes every check on every cpu case, and the ``--backend`` wiring rejects a mutant end to end."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.dense.checks import (
    NAMED_CHECKS,
    check_within_error_bound_figures,
    failing_checks,
    failing_checks_of_run,
    run_dense_case,
    single_rounding_figures,
)
from conformance.dense.cases import CPU_CASES
from conformance.dense.diagnosis import PATTERNS, RULES, diagnose_dense_cases, diagnose_run
from tests.dense.mutants import (MUTANTS, VARIANTS, GlobalScaleDoubled, GlobalScaleDropped, NibbleSwapped,
                                 pattern_probe_cases)

REPO = Path(__file__).resolve().parents[2]


def test_every_mutant_names_a_real_check():
    assert len(MUTANTS) >= 22
    for mutant in MUTANTS:
        assert mutant.caught_by in NAMED_CHECKS, f"{mutant.__name__}.caught_by = {mutant.caught_by!r}"


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.__name__)
def test_mutant_is_rejected(mutant, record_property):
    backend = mutant()
    for case in CPU_CASES:  # stop at the first case where the expected check fires
        failures = failing_checks(backend, case)
        if mutant.caught_by in failures:
            record_property("caught_by", f"{sorted(failures)} on {case.id}")
            return
    pytest.fail(f"{mutant.__name__} ({mutant.__doc__.strip()}) passed {mutant.caught_by} on every cpu case")


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.__name__)
def test_correct_variant_is_accepted(variant, record_property):
    """Every named check passes on every cpu case; the worst figures are recorded (junit properties): the bound
    ratio over all cases, and on the single-rounding cases the direction statistic and the ulp error spread
    as fractions of their limits."""
    backend = variant()
    results, diagnosed = [], {}
    rejected, worst = {}, {"bound_ratio": 0.0, "toward_zero_fraction": 0.0, "direction_vs_limit": 0.0,
                           "mean_sq_ulps": 0.0, "spread_vs_limit": 0.0}
    for case in CPU_CASES:
        run = run_dense_case(backend, case)
        failures = failing_checks_of_run(run, backend)
        results.append((case, failures))
        if diagnose_run(run, failures):
            diagnosed[case.id] = [str(d) for d in diagnose_run(run, failures)]
        if failures:
            rejected[case.id] = failures
            continue
        worst["bound_ratio"] = max(worst["bound_ratio"], check_within_error_bound_figures(run).bound_ratio)
        if case.strict_checks:
            fig = single_rounding_figures(run)
            worst["toward_zero_fraction"] = max(worst["toward_zero_fraction"], fig.toward_zero_fraction)
            worst["direction_vs_limit"] = max(worst["direction_vs_limit"], fig.toward_zero_fraction / fig.direction_limit)
            worst["mean_sq_ulps"] = max(worst["mean_sq_ulps"], fig.mean_sq_ulps)
            worst["spread_vs_limit"] = max(worst["spread_vs_limit"], fig.mean_sq_ulps / fig.mean_sq_ulps_limit)
    for name, value in worst.items():
        record_property(f"worst_{name}", round(value, 4))
    assert not rejected, f"{variant.__name__} ({variant.__doc__.strip()}) was rejected: {rejected}"
    # no diagnosis rule fires on a correct variant, per run or across the cases
    assert not diagnosed and not diagnose_dense_cases(results), (diagnosed, diagnose_dense_cases(results))


def test_backend_option_runs_a_mutant_end_to_end():
    cmd = [sys.executable, "-m", "pytest", "conformance/dense/test_dense.py", "-m", "cpu", "-q", "-x",
           "-p", "no:cacheprovider", "--backend", "tests.dense.mutants:NibbleSwapped"]
    env = {k: v for k, v in os.environ.items() if k != "NVFP4_CONFORMANCE_BACKEND"}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 1, f"expected test failures (exit 1), got {done.returncode}:\n{done.stdout}\n{done.stderr}"
    assert "outside the derived error bound" in done.stdout, done.stdout[-3000:]
    assert "[NibbleSwapped-cpu-" in done.stdout, "the test ids should name the backend under test"


def test_docs_adapter_example_is_correct():
    """The vendor adapter example in docs/dense.md runs and passes every check (a correct variant too)."""
    import re

    text = (REPO / "docs" / "dense.md").read_text()
    source = re.search(r"```python\n(# my_adapter\.py.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(source, "docs/dense.md:my_adapter.py", "exec"), namespace)
    backend = namespace["MyW4A16"]()
    for case in CPU_CASES:
        if case.id in ("cpu-awq-bias-3d", "cpu-fused-qkv-3-scales", "cpu-noncontiguous-3d", "cpu-nonfinite-3d-bias"):
            assert backend.skip_reason(case.info()) is None
            assert failing_checks(backend, case) == {}, case.id
    declined = next(c for c in CPU_CASES if c.k % 32)
    assert "K % 32" in backend.skip_reason(declined.info())


# ------------------------------------------------------------------------------------------ diagnosis
DIAGNOSED = [m for m in MUTANTS if m.diagnosed_as]


def _names(mutant) -> tuple[str, ...]:
    return (mutant.diagnosed_as,) if isinstance(mutant.diagnosed_as, str) else mutant.diagnosed_as


def test_every_rule_and_pattern_has_a_mutant_or_red_team_backend():
    from tests.dense.test_dense_redteam import DENSE_DIAGNOSED, DENSE_PATTERNS

    shown = {n for m in DIAGNOSED for n in _names(m)} | {r for _, _, r in DENSE_DIAGNOSED} | {p for _, p in DENSE_PATTERNS}
    declared = {r.name for r in RULES} | {p.name for p in PATTERNS}
    assert shown <= declared, f"mutants name unknown rules: {sorted(shown - declared)}"
    assert declared <= shown, f"rules/patterns no mutant shows: {sorted(declared - shown)}"


@pytest.mark.parametrize("mutant", DIAGNOSED, ids=lambda m: m.__name__)
def test_mutant_is_diagnosed(mutant, record_property):
    """The rule a mutant declares fires on a cpu case where a check rejects it; the pattern it declares fires
    across the probe cases of that pattern (``pattern_probe_cases``: cases with and without its feature)."""
    backend = mutant()
    rule_names = {r.name for r in RULES}
    for name in _names(mutant):
        if name in rule_names:
            seen = {}
            for case in CPU_CASES:
                run = run_dense_case(backend, case)
                failures = failing_checks_of_run(run, backend)
                if failures:
                    seen[case.id] = [d.rule for d in diagnose_run(run, failures)]
                    if name in seen[case.id]:
                        record_property(f"diagnosis_{name}", case.id)
                        break
            else:
                pytest.fail(f"{mutant.__name__}: rule {name!r} fired on no failing cpu case; diagnoses: {seen}")
        else:
            results = [(c, failing_checks(backend, c)) for c in pattern_probe_cases(name)]
            found = {d.rule for d in diagnose_dense_cases(results)}
            assert name in found, f"{mutant.__name__}: pattern {name!r} not found; found {sorted(found)}"


def test_diagnosis_is_appended_to_the_failure_message():
    from conformance.dense.checks import check_within_error_bound
    from conformance.dense.diagnosis import diagnosed

    backend = NibbleSwapped()
    run = run_dense_case(backend, next(c for c in CPU_CASES if c.id == "cpu-m7-n160-k256"))
    recorded = {}
    with pytest.raises(AssertionError) as info:
        with diagnosed(run, backend, lambda k, v: recorded.__setitem__(k, v)):
            check_within_error_bound(run)
    text = str(info.value)
    assert text.startswith("W4A16 output outside the derived error bound")
    assert "likely cause [nibble_swapped]: the output matches the checkpoint read with the two E2M1 codes" in text
    assert recorded["diagnosis"].startswith("nibble_swapped:")



@pytest.mark.parametrize("mutant", [GlobalScaleDropped, GlobalScaleDoubled, NibbleSwapped], ids=lambda m: m.__name__)
def test_reading_mutants_get_their_reading_first_and_no_unsupported_cause(mutant):
    """On every cpu case where a check rejects the mutant and its reading applies, that reading is the first
    diagnosis, and no rounding or location rule follows it (the reading explains their evidence: issue 37 saw a
    dropped weight_scale_2 diagnosed as bf16_partial_sums, a nibble swap with bf16_partial_sums first)."""
    from conformance.dense.diagnosis import SUBSUMED_BY_A_READING

    backend, failing_cases, first = mutant(), 0, {}
    for case in CPU_CASES:
        run = run_dense_case(backend, case)
        failures = failing_checks_of_run(run, backend)
        if "check_within_error_bound" not in failures:
            continue
        names = [d.rule for d in diagnose_run(run, failures)]
        if mutant.diagnosed_as not in names:
            continue  # this case's data does not separate the reading (e.g. weight_scale_2 == 1)
        failing_cases += 1
        first[case.id] = names
        assert names[0] == mutant.diagnosed_as, f"{case.id}: {names}"
        assert not set(names) & SUBSUMED_BY_A_READING, f"{case.id}: {names}"
    assert failing_cases >= 3, f"{mutant.__name__}: diagnosed on {failing_cases} cases only: {first}"



def test_golden_comparison_failures_are_diagnosed(tmp_path):
    """test_dense_matches_golden's failures carry the same likely causes as the live cases' (issue 37: they carried
    none): a backend that never applies weight_scale_2, run against the shipped golden data."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "pytest", "conformance/dense/test_dense_golden.py", "-q", "-p",
                        "no:cacheprovider", "-n", "0", "--backend", "tests.dense.mutants:GlobalScaleDropped",
                        "-k", "cpu", f"--junitxml={tmp_path / 'r.xml'}"], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 1, r.stdout[-2000:]
    assert "likely cause [global_scale_missing]" in r.stdout, r.stdout[-3000:]
