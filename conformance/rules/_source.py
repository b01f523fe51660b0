"""The upstream-source helpers (run single statements of an engine's function, taken from its installed source)
now live in :mod:`conformance.interfaces.upstream_source`, where adapters import them; re-exported here."""
from __future__ import annotations

from conformance.interfaces.upstream_source import (  # noqa: F401 - re-exported: the names this module offered
    _globals,
    _only,
    _tree,
    eval_assignment,
    eval_if_test,
    run_nested_if,
)
