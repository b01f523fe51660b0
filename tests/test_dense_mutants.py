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
from tests.mutants.dense import MUTANTS, VARIANTS

REPO = Path(__file__).resolve().parents[1]


def test_every_mutant_names_a_real_check():
    assert len(MUTANTS) >= 17
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
    rejected, worst = {}, {"bound_ratio": 0.0, "toward_zero_fraction": 0.0, "direction_vs_limit": 0.0,
                           "mean_sq_ulps": 0.0, "spread_vs_limit": 0.0}
    for case in CPU_CASES:
        run = run_dense_case(backend, case)
        failures = failing_checks_of_run(run, backend)
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


def test_backend_option_runs_a_mutant_end_to_end():
    cmd = [sys.executable, "-m", "pytest", "conformance/dense/test_dense.py", "-m", "cpu", "-q", "-x",
           "-p", "no:cacheprovider", "--backend", "tests.mutants.dense:NibbleSwapped"]
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
