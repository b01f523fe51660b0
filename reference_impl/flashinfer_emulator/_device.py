"""The emulated GPU: which compute capability the emulator pretends to run on, and FlashInfer's error types.

FlashInfer decides many things from ``get_compute_capability(tensor.device)`` (which backends exist,
which weight layout ``cute-dsl`` prepares). The emulator runs on any device, CPU included, so the
capability is a setting: SM100 (B200) unless ``FLASHINFER_EMULATOR_CC`` or :func:`emulated_capability`
says otherwise. Tensors on any device are treated as living on that one emulated GPU; only *mismatches*
between the devices of two operands are errors, as on the real library.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

_DEFAULT_CC = 100
_override: list[int] = []


class BackendSupportedError(Exception):
    """Same name and base class as ``flashinfer.utils.BackendSupportedError`` (a plain ``Exception``,
    deliberately *not* a ``ValueError``: FlashInfer raises it for an unknown or unsupported backend)."""


def current_capability() -> int:
    """The emulated compute capability as ``major * 10 + minor`` (100 = SM100)."""
    if _override:
        return _override[-1]
    env = os.environ.get("FLASHINFER_EMULATOR_CC")
    if env:
        try:
            return int(env)
        except ValueError as exc:
            raise ValueError(f"FLASHINFER_EMULATOR_CC must be an integer like 100 or 103, got {env!r}") from exc
    return _DEFAULT_CC


def current_major_minor() -> tuple[int, int]:
    cc = current_capability()
    return cc // 10, cc % 10


@contextlib.contextmanager
def emulated_capability(cc: int) -> Iterator[None]:
    """Run a block as if on a GPU of capability ``cc`` (e.g. 103, 120)."""
    _override.append(int(cc))
    try:
        yield
    finally:
        _override.pop()


def uses_sm100_layout() -> bool:
    """SM100-family cute-dsl keeps the canonical uint8 weight and a 6-D scale view (FlashInfer's
    ``_cute_dsl_uses_sm100_layout``): SM100, SM103, SM107."""
    return current_major_minor() in ((10, 0), (10, 3), (10, 7))
