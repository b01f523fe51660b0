"""The suite's pytest plugin. Loaded by the repository's root ``conftest.py``; when the suite is
installed as a package, load it with ``pytest -p conformance.plugin``. The top layer: it alone names every
area's plugin (each registers its options, fixtures and report sections with the framework)."""
from __future__ import annotations

import importlib

pytest_plugins = [
    "conformance._framework.tier_markers",
    "conformance._framework.selection_plugin",
    "conformance.rules.plugin",
    "conformance._framework.snapshot_fixture",
    "conformance._framework.expectations",
    "conformance._framework.report_files",
    "conformance.engine_harness.plugin",
    "conformance.server.plugin",
    "conformance.perf.plugin",
    "conformance.dense.plugin",
    "conformance.moe.plugin",
]


def load_report_parts() -> None:
    """Import every plugin module, so that their report sections and case diagnoses are registered: what a
    report rendered outside pytest (ci/run_conformance.py) needs."""
    for name in pytest_plugins:
        importlib.import_module(name)
