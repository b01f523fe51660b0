"""The ``rules_engine`` fixture: which engine's configuration/guard rules are under test.

Selected by ``--engine NAME|module:attr`` (the option is shared with the integration harness plugin, which
registers it: ``--engine sglang`` runs both against SGLang) or ``$NVFP4_CONFORMANCE_ENGINE``; default
``reference``. A ``module:attr`` that is not a RulesEngine (e.g. a harness EngineAdapter) skips the rule cases.
"""
from __future__ import annotations

import pytest

from ..engines import EngineLoadError, EngineUnavailable, engine_spec, load_engine


@pytest.fixture(scope="session")
def rules_engine(request: pytest.FixtureRequest):
    """The engine under test, built once (importing SGLang takes tens of seconds); skips every rule case with
    the reason when the engine cannot run here (e.g. SGLang not installed)."""
    requested = request.config.getoption("--engine", default=None)
    spec = engine_spec(requested)
    try:
        return load_engine(spec)
    except EngineUnavailable as exc:
        if requested:  # asked for by name: not being able to run it is a failure, not a skip
            pytest.fail(f"--engine {spec!r} was requested but cannot run here: {exc}", pytrace=False)
        pytest.skip(f"engine {spec!r} unavailable: {exc}")
    except EngineLoadError as exc:
        if ":" in spec:
            pytest.skip(f"--engine {spec!r} has no configuration-rules adapter: {exc}")
        raise pytest.UsageError(str(exc)) from exc
