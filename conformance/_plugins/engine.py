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
    spec = engine_spec(request.config.getoption("--engine", default=None))
    try:
        return load_engine(spec)
    except EngineUnavailable as exc:
        pytest.skip(f"engine {spec!r} unavailable: {exc}")
    except EngineLoadError as exc:
        if ":" in spec:
            pytest.skip(f"--engine {spec!r} has no configuration-rules adapter: {exc}")
        raise pytest.UsageError(str(exc)) from exc
