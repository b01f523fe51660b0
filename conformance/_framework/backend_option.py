"""``--backend``: which implementation is under test; the ``backend`` fixture. The option is resolved once per
session and kept in the config's stash (:func:`backends_of`)."""
from __future__ import annotations

import pytest

from conformance.interfaces.kernel import Backend
from conformance._framework.selection import (
    BACKEND_ENV_VAR,
    DEFAULT_BACKEND,
    BackendLoadError,
    backend_spec_from_env,
    load_backends,
)

BACKENDS_KEY = pytest.StashKey[list]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("nvfp4", "NVFP4 W4A16 conformance")
    group.addoption(
        "--backend",
        default=None,
        help=f"backend under test: a built-in name (reference, flashinfer) or module:attr "
        f"(default: ${BACKEND_ENV_VAR} or '{DEFAULT_BACKEND}')",
    )


def backends_of(config: pytest.Config) -> list[Backend]:
    """The backends ``--backend`` (or its environment variable) selects, loaded once per session."""
    cached = config.stash.get(BACKENDS_KEY, None)
    if cached is None:
        spec = backend_spec_from_env(config.getoption("--backend"))
        try:
            cached = load_backends(spec)
        except BackendLoadError as exc:
            raise pytest.UsageError(str(exc)) from exc
        config.stash[BACKENDS_KEY] = cached
    return cached


def pytest_report_header(config: pytest.Config) -> str:
    try:
        names = ", ".join(f"{b.name} ({b.version()})" for b in backends_of(config))
    except pytest.UsageError as exc:
        return f"nvfp4 backend: {exc}"
    return f"nvfp4 backend under test: {names}"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames:
        backends = backends_of(metafunc.config)
        metafunc.parametrize("backend", backends, ids=[b.name for b in backends], scope="session")
