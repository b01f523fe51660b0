"""Backend selection: ``--backend NAME`` for a built-in one, ``--backend module:attr`` for a vendor's."""
from __future__ import annotations

import importlib
import os
from collections.abc import Iterable

from ..adapter import Backend

BACKEND_ENV_VAR = "NVFP4_CONFORMANCE_BACKEND"
DEFAULT_BACKEND = "reference"
BUILTIN_BACKENDS = {
    "reference": "conformance.backends.reference:ReferenceBackend",
    "flashinfer": "conformance.backends.flashinfer:all_backends",
}


class BackendLoadError(RuntimeError):
    """The backend named on the command line could not be imported or built."""


def backend_spec_from_env(cli_value: str | None) -> str:
    return cli_value or os.environ.get(BACKEND_ENV_VAR) or DEFAULT_BACKEND


def load_backends(spec: str) -> list[Backend]:
    """Resolve ``spec`` (a built-in name or ``module:attr``; several separated by commas, e.g.
    ``reference,mymodule:MyBackend`` to run a backend next to the reference) to one or more backend
    instances. ``attr`` may be a :class:`Backend` subclass, an instance, or a zero-argument callable
    returning an instance or a list of instances (one per kernel variant, each its own parametrization)."""
    if "," in spec:
        backends = [b for part in spec.split(",") if part.strip() for b in load_backends(part.strip())]
        names = [b.name for b in backends]
        if len(set(names)) != len(names):
            raise BackendLoadError(f"{spec}: backend names must be distinct, got {names}")
        return backends
    target = BUILTIN_BACKENDS.get(spec, spec)
    if ":" not in target:
        raise BackendLoadError(
            f"unknown backend {spec!r}: use one of {sorted(BUILTIN_BACKENDS)} or 'module:attr'"
        )
    module_name, attr = target.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendLoadError(f"cannot import backend module {module_name!r}: {exc}") from exc
    try:
        obj = getattr(module, attr)
    except AttributeError as exc:
        raise BackendLoadError(f"module {module_name!r} has no attribute {attr!r}") from exc
    if isinstance(obj, type) and issubclass(obj, Backend):
        obj = obj()
    elif not isinstance(obj, Backend) and callable(obj):
        obj = obj()
    backends = [obj] if isinstance(obj, Backend) else list(obj) if isinstance(obj, Iterable) else [obj]
    for b in backends:
        if not isinstance(b, Backend):
            raise BackendLoadError(f"{target} produced {b!r}, which is not a conformance.adapter.Backend")
    if not backends:
        raise BackendLoadError(f"{target} produced no backend")
    return backends
