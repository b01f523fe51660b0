"""The suite's pytest plugin. Loaded by the repository's root ``conftest.py``; when the suite is
installed as a package, load it with ``pytest -p conformance.plugin``."""

pytest_plugins = [
    "conformance._framework.tier_markers",
    "conformance._framework.backend_option",
    "conformance.rules.plugin",
    "conformance._framework.snapshot_fixture",
    "conformance._framework.expectations",
    "conformance._framework.report_files",
    "conformance.engine_harness.plugin",
    "conformance.server.plugin",
    "conformance.perf.plugin",
]
