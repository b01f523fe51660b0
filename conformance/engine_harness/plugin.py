"""The ``engine_adapter`` fixture: the engine's integration code (``--engine``, registered by the one selection
plugin) that the harness runs against the FlashInfer emulator (skips, with the adapter's reason, when the engine is not installed)."""
from __future__ import annotations

import pytest

from conformance._framework.selection_plugin import selected
from conformance.engine_harness import EngineLoadError, NotALayerCodeEngine, load_layer_code_engine


@pytest.fixture(scope="session")
def engine_adapter(pytestconfig: pytest.Config):
    try:
        adapter = load_layer_code_engine(selected(pytestconfig).engine)
    except NotALayerCodeEngine as exc:  # e.g. a RulesEngine: its rule tests run, these skip
        pytest.skip(str(exc))
    except EngineLoadError as exc:
        raise pytest.UsageError(str(exc)) from exc
    reason = adapter.skip_reason()
    if reason and selected(pytestconfig).engine_named:  # asked for by name: a failure, not a skip
        pytest.fail(f"--engine {adapter.name!r} was requested but cannot run here: {reason}", pytrace=False)
    if reason:
        pytest.skip(f"engine {adapter.name!r} not runnable here: {reason}")
    return adapter
