"""The ``rules_engine`` fixture: which engine's configuration/guard rules are under test; ``rules_profile``:
which rules profile's expected outcomes they are judged by; ``rules_check``: run one matrix case.

Selected by ``--engine NAME|module:attr`` (the option is shared with the integration harness plugin, which
registers it: ``--engine sglang`` runs both against SGLang) or ``$NVFP4_CONFORMANCE_ENGINE``; default
``reference``. A ``module:attr`` that is not a RulesEngine (e.g. a harness LayerCodeEngine) skips the rule cases.
The profile: ``--rules-profile NAME`` or ``$NVFP4_RULES_PROFILE``, default sglang-0.5.23 (vllm-0.32 for ``--engine vllm``)
(fixtures/config_rules/profiles/). Each rule case records the engine (with its version) and the profile for
the report (``--report-dir``).
"""
from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from conformance.rules import ENGINE_DEFAULT_PROFILES, EngineLoadError, EngineUnavailable, engine_spec, load_rules_engine
from conformance.rules.matrix import DEFAULT_PROFILE, RuleCase, check_case, load_profile, profile_names

PROFILE_ENV_VAR = "NVFP4_RULES_PROFILE"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("nvfp4", "NVFP4 W4A16 conformance")
    group.addoption(
        "--rules-profile",
        default=None,
        help=f"rules profile whose expected outcomes the rule matrices use: {', '.join(profile_names())} "
        f"(default: ${PROFILE_ENV_VAR} or {DEFAULT_PROFILE})",
    )


@pytest.fixture(scope="session")
def rules_profile(pytestconfig: pytest.Config) -> str:
    default = ENGINE_DEFAULT_PROFILES.get(engine_spec(pytestconfig.getoption("--engine", default=None)), DEFAULT_PROFILE)
    name = pytestconfig.getoption("--rules-profile") or os.environ.get(PROFILE_ENV_VAR) or default
    try:
        load_profile(name)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from exc
    return name


@pytest.fixture(scope="session")
def rules_engine(request: pytest.FixtureRequest, rules_profile: str):
    """The engine under test, built once (importing SGLang takes tens of seconds) and told the profile;
    skips every rule case with the reason when the engine cannot run here (e.g. SGLang not installed)."""
    requested = request.config.getoption("--engine", default=None)
    spec = engine_spec(requested)
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
