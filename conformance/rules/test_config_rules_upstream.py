"""The upstream-expectations oracle: expectations written by hand from SGLang's own unit tests
(fixtures/config_rules/upstream_expectations.json), an independent check of the rule matrices' outcomes.
Each entry asks the engine under test the same question the upstream test asks; a disagreement fails and
shows both sides; an entry that does not hold for the rules profile under test (or whose area the profile does
not model) skips with the reason. Counts per area: python ci/rules_matrix.py --engine NAME."""
from __future__ import annotations

import pytest

from conformance.rules.oracle import DISAGREE, NOT_APPLICABLE, judge, load_expectations


@pytest.mark.parametrize("expectation", [pytest.param(e, id=e.id, marks=pytest.mark.cpu) for e in load_expectations()])
def test_upstream_expectation(request, rules_engine, rules_profile, expectation):
    request.node.user_properties.append(("rules_engine", f"{rules_engine.name} ({rules_engine.version()})"))
    request.node.user_properties.append(("rules_profile", rules_profile))
    verdict, detail = judge(rules_engine, expectation, rules_profile)
    if verdict == NOT_APPLICABLE:
        pytest.skip(detail)
    assert verdict != DISAGREE, detail
