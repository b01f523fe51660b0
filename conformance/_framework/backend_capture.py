"""Backend-call capture for failure artifacts: while a test runs with ``--artifacts-dir``/``--report-dir``, the
backend instance's entry points are wrapped so that their tensor arguments and results are kept; a failing test's
artifacts then carry its inputs and outputs even when the check registered nothing itself. Used by
:mod:`conformance._framework.report_files` (the pytest side of the reports)."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from conformance._framework.reporting import Artifacts

# Backend entry points whose tensor arguments and results are kept for a failing test's artifacts, so every
# backend-driven failure ships its inputs and outputs even when the check registered nothing itself.
_CAPTURED = {
    "prepare_dense": ("layer", "device"),
    "run_dense": ("prepared", "x"),
    "prepare_moe": ("experts", "device"),
    "run_moe": ("prepared", "x", "topk_ids", "topk_weights"),
}
_MAX_CAPTURED_CALLS = 4  # per entry point and test: enough to see the case, bounded for big sweeps
_ABSENT = object()


def _tensors_of(prefix: str, value: Any) -> dict[str, torch.Tensor]:
    """Tensors in ``value`` (a tensor, or a dataclass such as DenseLayer / MoEExperts) keyed by ``prefix``."""
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f"{prefix}.{f.name}": getattr(value, f.name) for f in dataclasses.fields(value)
                if isinstance(getattr(value, f.name), torch.Tensor)}
    return {}


def capture_backend_calls(backend: Any, artifacts: Artifacts):
    """Wrap the backend instance's entry points for one test; returns the function that unwraps them."""
    own = getattr(backend, "__dict__", None)
    if backend is None or own is None:  # no backend, or one with __slots__: nothing to wrap
        return None
    wrapped: dict[str, Any] = {}  # method -> what the instance itself held under that name (or _ABSENT)
    for method, arg_names in _CAPTURED.items():
        original = getattr(backend, method, None)
        if original is None:
            continue

        def capture(*args, _original=original, _method=method, _names=arg_names, _calls=[0], **kwargs):
            n = _calls[0]
            _calls[0] += 1
            if n >= _MAX_CAPTURED_CALLS:
                return _original(*args, **kwargs)
            tensors = {}
            for name, value in [*zip(_names, args), *kwargs.items()]:
                tensors.update(_tensors_of(f"{_method}.{n}.{name}", value))
            if tensors:
                artifacts.save("backend_calls", **tensors)  # inputs first: kept even when the call raises
            out = _original(*args, **kwargs)
            if _method.startswith("run_") and isinstance(out, torch.Tensor):
                artifacts.save("backend_calls", **{f"{_method}.{n}.out": out})
            return out

        previous = own.get(method, _ABSENT)
        try:
            setattr(backend, method, capture)
        except (AttributeError, TypeError):  # a backend refusing attributes: no capture, nothing breaks
            continue
        wrapped[method] = previous

    def restore() -> None:
        for method, previous in wrapped.items():
            if previous is _ABSENT:
                own.pop(method, None)
            else:
                own[method] = previous

    return restore
