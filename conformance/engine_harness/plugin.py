"""``--engine``: which engine's integration code the harness runs against the FlashInfer emulator;
the ``engine_adapter`` fixture (skips, with the adapter's reason, when the engine is not installed)."""
from __future__ import annotations

import pytest

from conformance.rules import DEFAULT_ENGINE as DEFAULT_RULES_ENGINE, ENGINE_ENV_VAR as RULES_ENGINE_ENV_VAR
from conformance.engine_harness import DEFAULT_ENGINE, ENGINE_ENV_VAR, EngineLoadError, NotALayerCodeEngine, load_layer_code_engine


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("nvfp4", "NVFP4 W4A16 conformance")
    group.addoption(
        "--engine",
        default=None,
        help=f"engine under test: a built-in name (reference, sglang, vllm) or module:attr naming a RulesEngine "
        f"(configuration rules) and/or LayerCodeEngine (layer code under the harness) subclass; default: "
        f"${RULES_ENGINE_ENV_VAR} or '{DEFAULT_RULES_ENGINE}' for the rules, ${ENGINE_ENV_VAR} or "
        f"'{DEFAULT_ENGINE}' for the harness",
    )


@pytest.fixture(scope="session")
def engine_adapter(pytestconfig: pytest.Config):
    try:
        adapter = load_layer_code_engine(pytestconfig.getoption("--engine"))
    except NotALayerCodeEngine as exc:  # e.g. a RulesEngine: its rule tests run, these skip
        pytest.skip(str(exc))
    except EngineLoadError as exc:
        raise pytest.UsageError(str(exc)) from exc
    reason = adapter.skip_reason()
    if reason and pytestconfig.getoption("--engine"):  # asked for by name: a failure, not a skip
        pytest.fail(f"--engine {adapter.name!r} was requested but cannot run here: {reason}", pytrace=False)
    if reason:
        pytest.skip(f"engine {adapter.name!r} not runnable here: {reason}")
    return adapter
