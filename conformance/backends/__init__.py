"""Backend selection: ``--backend NAME`` for a built-in one, ``--backend module:attr`` for a vendor's, several
separated by commas. Without ``--backend`` (and without ``$NVFP4_CONFORMANCE_BACKEND``) the suite runs the
reference backend and FlashInfer's W4A16 kernels (the ``b200`` tier: skipped, with the reason, elsewhere)."""
from __future__ import annotations

import importlib
import os
from collections.abc import Iterable

from conformance.interfaces.kernel import Backend

BACKEND_ENV_VAR = "NVFP4_CONFORMANCE_BACKEND"
DEFAULT_BACKEND = "reference,flashinfer"
BUILTIN_BACKENDS = {
    "reference": "conformance.backends.reference:ReferenceBackend",
    "flashinfer": "conformance.backends.flashinfer:all_backends",
}


class BackendLoadError(RuntimeError):
    """The backend named on the command line could not be imported or built."""


def backend_spec_from_env(cli_value: str | None) -> str:
    return cli_value or os.environ.get(BACKEND_ENV_VAR) or DEFAULT_BACKEND


def load_backends(spec: str) -> list[Backend]:
    """Resolve ``spec`` (built-in names or ``module:attr``, comma-separated) to backend instances.
    ``attr`` may be a :class:`Backend` subclass, an instance, or a zero-argument callable returning an
    instance or a list of instances (one per kernel variant, each its own parametrization)."""
    parts = [p.strip() for p in spec.split(",")]
    if not all(parts):
        raise BackendLoadError(f"empty backend name in {spec!r}")
    backends = [b for part in parts for b in _load_one(part)]
    names = [b.name for b in backends]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise BackendLoadError(f"{spec!r} names backend(s) {duplicates} more than once (test ids must be unique)")
    return backends


def _load_one(spec: str) -> list[Backend]:
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
            raise BackendLoadError(f"{target} produced {b!r}, which is not a conformance.interfaces.kernel.Backend")
    if not backends:
        raise BackendLoadError(f"{target} produced no backend")
    return backends
