"""The ``rules_engine`` fixture: which engine's configuration/guard rules are under test; ``rules_profile``:
which rules profile's expected outcomes they are judged by; ``rules_check``: run one matrix case.

Selected by ``--engine NAME|module:attr`` (the one selection plugin registers it, for the rules and the
integration harness alike: ``--engine sglang`` runs both against SGLang) or ``$NVFP4_CONFORMANCE_ENGINE``; default
``reference``. A ``module:attr`` that is not a RulesEngine (e.g. a harness LayerCodeEngine) skips the rule cases.
The profile: ``--rules-profile NAME`` or ``$NVFP4_RULES_PROFILE``, default sglang-0.5.23 (vllm-0.32 for ``--engine vllm``)
(fixtures/config_rules/profiles/). Each rule case records the engine (with its version) and the profile for
the report (``--report-dir``).
"""
from __future__ import annotations

from collections.abc import Callable

import pytest

from conformance._framework.selection_plugin import selected
from conformance.rules import ENGINE_DEFAULT_PROFILES, EngineLoadError, EngineUnavailable, load_rules_engine
from conformance.rules.matrix import DEFAULT_PROFILE, RuleCase, check_case, load_profile, profile_names

PROFILE_ENV_VAR = "NVFP4_RULES_PROFILE"  # the option and its variable: conformance/_framework/selection_plugin.py


@pytest.fixture(scope="session")
def rules_profile(pytestconfig: pytest.Config) -> str:
    chosen = selected(pytestconfig)
    name = chosen.rules_profile or ENGINE_DEFAULT_PROFILES.get(chosen.engine_for("rules"), DEFAULT_PROFILE)
    try:
        load_profile(name)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from exc
    return name


@pytest.fixture(scope="session")
def rules_engine(request: pytest.FixtureRequest, rules_profile: str):
    """The engine under test, built once (importing SGLang takes tens of seconds) and told the profile;
    skips every rule case with the reason when the engine cannot run here (e.g. SGLang not installed)."""
    chosen = selected(request.config)
    requested, spec = chosen.engine_named, chosen.engine_for("rules")
    try:
        engine = load_rules_engine(spec)
    except EngineUnavailable as exc:
        if requested:  # asked for by name: not being able to run it is a failure, not a skip
            pytest.fail(f"--engine {spec!r} was requested but cannot run here: {exc}", pytrace=False)
        pytest.skip(f"engine {spec!r} unavailable: {exc}")
    except EngineLoadError as exc:
        if ":" in spec:
            pytest.skip(f"--engine {spec!r} has no configuration-rules adapter: {exc}")
        raise pytest.UsageError(str(exc)) from exc
    engine.use_profile(rules_profile)
    return engine


@pytest.fixture
def rules_check(request: pytest.FixtureRequest, rules_engine, rules_profile: str) -> Callable[[RuleCase], None]:
    """``rules_check(case)``: skip with the engine's reason if it cannot run the case, else assert the
    engine's outcome is the one the profile expects."""
    request.node.user_properties.append(("rules_engine", f"{rules_engine.name} ({rules_engine.version()})"))
    request.node.user_properties.append(("rules_profile", rules_profile))

    def check(case: RuleCase) -> None:
        reason = case.not_modelled(rules_profile) or rules_engine.unsupported(case.matrix, case.inputs)
        if reason:
            pytest.skip(reason)
        check_case(rules_engine, case, rules_profile)

    return check
