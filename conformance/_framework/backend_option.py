"""``--backend``: which implementation is under test; the ``backend`` fixture."""
from __future__ import annotations

import pytest

from conformance.interfaces.kernel import Backend
from conformance.backends import BACKEND_ENV_VAR, DEFAULT_BACKEND, BackendLoadError, backend_spec_from_env, load_backends


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("nvfp4", "NVFP4 W4A16 conformance")
    group.addoption(
        "--backend",
        default=None,
        help=f"backend under test: a built-in name (reference, flashinfer) or module:attr "
        f"(default: ${BACKEND_ENV_VAR} or '{DEFAULT_BACKEND}')",
    )


def _backends(config: pytest.Config) -> list[Backend]:
    cached = getattr(config, "_nvfp4_backends", None)
    if cached is None:
        spec = backend_spec_from_env(config.getoption("--backend"))
        try:
            cached = load_backends(spec)
        except BackendLoadError as exc:
            raise pytest.UsageError(str(exc)) from exc
        config._nvfp4_backends = cached
    return cached


def pytest_report_header(config: pytest.Config) -> str:
    try:
        names = ", ".join(f"{b.name} ({b.version()})" for b in _backends(config))
    except pytest.UsageError as exc:
        return f"nvfp4 backend: {exc}"
    return f"nvfp4 backend under test: {names}"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames:
        backends = _backends(metafunc.config)
        metafunc.parametrize("backend", backends, ids=[b.name for b in backends], scope="session")
