"""What a machine's GPUs are, and whether the ``b200`` tier is emulated: the value types an adapter that checks
its own hardware (FlashInfer's, :mod:`conformance.adapters.flashinfer.platform`) and the framework's tiers
(:mod:`conformance._framework.tiers`, which re-exports these names) share.

``b200`` can be *emulated* (``pytest --flashinfer-emulated``, :func:`set_b200_emulation`, or
``$NVFP4_FLASHINFER_EMULATED=1``): FlashInfer's entry points are then the emulator's, run on this host's device;
such runs are rehearsals of the b200 code path, never B200 results. The switch lives here, one per process.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

#: ``1`` in the environment has the same effect as :func:`set_b200_emulation` (``--flashinfer-emulated``).
B200_EMULATION_ENV_VAR = "NVFP4_FLASHINFER_EMULATED"
#: The process-wide switch: empty until :func:`set_b200_emulation` is called (then the environment is not read).
_b200_emulation: list[bool] = []


def set_b200_emulation(enabled: bool) -> None:
    """Emulate the ``b200`` tier in this process (the ``--flashinfer-emulated`` option calls this)."""
    _b200_emulation[:] = [bool(enabled)]


def b200_emulated() -> bool:
    """Whether the ``b200`` tier is emulated: :func:`set_b200_emulation`, else ``$NVFP4_FLASHINFER_EMULATED``."""
    if _b200_emulation:
        return _b200_emulation[0]
    return os.environ.get(B200_EMULATION_ENV_VAR, "") == "1"


@dataclass(frozen=True)
class Gpu:
    """One GPU: its name and compute capability ``(major, minor)``."""

    name: str
    capability: tuple[int, int]

    def describe(self) -> str:
        return f"SM{self.capability[0]}{self.capability[1]} ({self.name})"


@dataclass(frozen=True)
class Hardware:
    """The GPUs a machine offers (none: CPU only)."""

    gpus: tuple[Gpu, ...] = ()

    def describe(self) -> str:
        if not self.gpus:
            return "no CUDA GPU (CPU only)"
        kinds: dict[str, int] = {}
        for g in self.gpus:
            kinds[g.describe()] = kinds.get(g.describe(), 0) + 1
        return ", ".join(f"{n} x {k}" if n > 1 else k for k, n in kinds.items())

    def count(self, capabilities=None) -> int:
        return sum(1 for g in self.gpus if capabilities is None or g.capability in capabilities)
