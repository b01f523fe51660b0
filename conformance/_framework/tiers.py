"""Hardware tiers: what a machine offers, and why a tier it lacks is skipped.

Tiers are pytest markers: ``cpu`` (always), ``cuda`` (any CUDA GPU), ``sm90`` (compute capability 9.0),
``b200`` (10.0 or 10.3), ``multi_gpu`` (2+ CUDA GPUs), ``b200_4gpu`` (4+ GPUs of capability 10.0/10.3).

A test parametrized by a backend needs the stricter of its case's tier and the backend's
(:func:`stricter_tier`): the FlashInfer backends need ``b200``, so every case run against them is a ``b200`` test.
``b200`` can be *emulated* (``pytest --flashinfer-emulated``, :func:`set_b200_emulation`): FlashInfer's entry
points are then the emulator's and run on this host's device (:func:`device_for_tier`); such runs are
rehearsals of the b200 code path, never B200 results. The hardware value types (:class:`Gpu`, :class:`Hardware`) and
the emulation switch live in :mod:`conformance.interfaces.hardware` (adapters read them there); this module
re-exports them.
"""
from __future__ import annotations

from functools import lru_cache

from conformance.interfaces.hardware import (  # noqa: F401 - re-exported: the names this module offered
    B200_EMULATION_ENV_VAR,
    Gpu,
    Hardware,
    b200_emulated,
    set_b200_emulation,
)

TIERS = ("cpu", "cuda", "sm90", "b200", "multi_gpu", "b200_4gpu")
TIER_DESCRIPTIONS = {
    "cpu": "runs anywhere (CPU)",
    "cuda": "needs any CUDA GPU",
    "sm90": "needs an SM90 (Hopper) GPU",
    "b200": "needs an SM100/SM103 (B200/B300) GPU",
    "multi_gpu": "needs 2 or more CUDA GPUs",
    "b200_4gpu": "needs 4 SM100/SM103 GPUs",
}
B200_CAPABILITIES = ((10, 0), (10, 3))
#: What each tier implies (a machine offering the key offers every tier in its set).
_IMPLIES = {
    "cpu": frozenset(),
    "cuda": frozenset({"cpu"}),
    "sm90": frozenset({"cpu", "cuda"}),
    "b200": frozenset({"cpu", "cuda"}),
    "multi_gpu": frozenset({"cpu", "cuda"}),
    "b200_4gpu": frozenset({"cpu", "cuda", "b200", "multi_gpu"}),
}
if set(_IMPLIES) != set(TIERS):  # a tier added to TIERS must say what it implies (stricter_tier needs it)
    raise RuntimeError(f"conformance._framework.tiers: _IMPLIES lists {sorted(_IMPLIES)}, TIERS has {sorted(TIERS)}")


class NoTierOffersBoth(ValueError):
    """Two tiers no machine offers together (``sm90`` + ``b200``)."""


def stricter_tier(a: str, b: str) -> str:
    """The least demanding tier that offers both ``a`` and ``b`` (``cpu`` + ``b200`` -> ``b200``, ``cuda`` +
    ``b200`` -> ``b200``, ``multi_gpu`` + ``b200`` -> ``b200_4gpu``); :class:`NoTierOffersBoth` when none does
    (``sm90`` + ``b200``: no GPU is both), ``ValueError`` for an unknown tier."""
    for tier in (a, b):
        if tier not in _IMPLIES:
            raise ValueError(f"unknown hardware tier {tier!r}; known: {', '.join(TIERS)}")
    both = [t for t in TIERS if {a, b} <= _IMPLIES[t] | {t}]
    least = [t for t in both if not any(o != t and o in _IMPLIES[t] for o in both)]
    if len(least) != 1:
        raise NoTierOffersBoth(f"no hardware tier offers both {a!r} and {b!r}")
    return least[0]


@lru_cache(maxsize=1)
def detect_hardware() -> Hardware:
    """The GPUs torch can see (none when torch has no CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return Hardware()
    gpus = []
    for i in range(torch.cuda.device_count()):
        gpus.append(Gpu(torch.cuda.get_device_name(i), tuple(torch.cuda.get_device_capability(i))))
    return Hardware(tuple(gpus))


def tier_skip_reason(tier: str, hw: Hardware) -> str | None:
    """``None`` when ``hw`` offers ``tier``; otherwise a reason naming what was found, e.g.
    ``"needs SM100/SM103, found SM90 (NVIDIA H200)"``."""
    found = hw.describe()
    if tier == "cpu":
        return None
    if tier == "cuda":
        return None if hw.gpus else f"needs a CUDA GPU, found {found}"
    if tier == "sm90":
        return None if hw.count({(9, 0)}) else f"needs SM90, found {found}"
    if tier == "b200":
        return None if hw.count(B200_CAPABILITIES) else f"needs SM100/SM103, found {found}"
    if tier == "multi_gpu":
        return None if len(hw.gpus) >= 2 else f"needs 2+ CUDA GPUs, found {found}"
    if tier == "b200_4gpu":
        n = hw.count(B200_CAPABILITIES)
        return None if n >= 4 else f"needs 4 SM100/SM103 GPUs, found {found}"
    raise ValueError(f"unknown hardware tier {tier!r}; known: {', '.join(TIERS)}")


def device_for_tier(tier: str) -> str:
    """The torch device a case of ``tier`` runs on: ``b200`` under emulation runs on this host's device
    (CUDA when there is one, else the CPU), every other GPU tier on CUDA."""
    if tier == "cpu":
        return "cpu"
    if tier == "b200" and b200_emulated():
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda"
