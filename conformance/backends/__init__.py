"""Backend selection: ``--backend NAME`` for a built-in one (the selection table's ``kernel`` column,
``conformance/_framework/selection.py``), ``--backend module:attr`` for a vendor's, several separated by
commas. Without ``--backend`` (and without ``$NVFP4_CONFORMANCE_BACKEND``) the suite runs the reference backend
and FlashInfer's W4A16 kernels (the ``b200`` tier: skipped, with the reason, elsewhere)."""
from __future__ import annotations

from collections.abc import Iterable

from conformance._framework import selection
from conformance.interfaces.kernel import Backend

BACKEND_ENV_VAR = selection.OPTIONS["--backend"].env
DEFAULT_BACKEND = selection.OPTIONS["--backend"].defaults["kernel"]
#: built-in name -> ``module:attr`` (a view of the selection table)
BUILTIN_BACKENDS = {n: selection.target_of(n, "kernel") for n in selection.names_for("kernel")}


class BackendLoadError(selection.SelectionError):
    """The backend named on the command line could not be imported or built."""


def backend_spec_from_env(cli_value: str | None) -> str:
    return selection.option_value("--backend", cli_value, "kernel")


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
    try:
        target = selection.target_of(spec, "kernel")
        obj = selection.import_target(target)
    except selection.SelectionError as exc:
        raise BackendLoadError(str(exc)) from exc
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
