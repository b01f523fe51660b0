"""The suite's pytest plugin. Loaded by the repository's root ``conftest.py``; when the suite is
installed as a package, load it with ``pytest -p conformance.plugin``."""

pytest_plugins = [
    "conformance._plugins.tiers",
    "conformance._plugins.backend",
    "conformance._plugins.engine",
    "conformance._plugins.snapshots",
    "conformance._plugins.expectations",
    "conformance._plugins.report",
    "conformance._plugins.harness",
    "conformance._plugins.server",
    "conformance._plugins.perf",
]
