"""``--engine``: which engine's integration code the harness runs against the FlashInfer emulator;
the ``engine_adapter`` fixture (skips, with the adapter's reason, when the engine is not installed)."""
from __future__ import annotations

import pytest

from conformance.engine_harness import ENGINE_ENV_VAR, EngineLoadError, NotALayerCodeEngine, load_layer_code_engine


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("nvfp4", "NVFP4 W4A16 conformance")
    group.addoption(
        "--engine",
        default=None,
        help=f"engine under the integration harness: a built-in name (sglang, vllm) or module:attr naming "
        f"a LayerCodeEngine subclass (default: ${ENGINE_ENV_VAR} or 'sglang')",
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
