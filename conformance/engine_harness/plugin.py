"""``--engine``: which engine's integration code the harness runs against the FlashInfer emulator;
the ``engine_adapter`` fixture (skips, with the adapter's reason, when the engine is not installed)."""
from __future__ import annotations

import pytest

from conformance._framework import selection
from conformance.engine_harness import EngineLoadError, NotALayerCodeEngine, load_layer_code_engine


_ENGINE = selection.OPTIONS["--engine"]


def _engine_names() -> list[str]:
    return list(dict.fromkeys(selection.names_for("rules") + selection.names_for("layer_code")))


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("nvfp4", "NVFP4 W4A16 conformance")
    group.addoption(
        "--engine",
        default=None,
        help=f"engine under test: a built-in name ({', '.join(_engine_names())}) or module:attr naming a "
        f"RulesEngine (configuration rules) and/or LayerCodeEngine (layer code under the harness) subclass; "
        f"default: ${_ENGINE.env}, else '{_ENGINE.defaults['rules']}' for the rules and "
        f"'{_ENGINE.defaults['layer_code']}' for the harness (the reference has no layer code)",
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
