"""Tier markers: register them, give each backend-parametrized test the stricter of its case's and its
backend's tier, and skip tests whose tier this machine lacks, with the reason. ``--flashinfer-emulated``
emulates the ``b200`` tier (see :mod:`conformance.tiers`)."""
from __future__ import annotations

import os

import pytest

from ..tiers import (
    TIER_DESCRIPTIONS,
    TIERS,
    b200_emulated,
    detect_hardware,
    set_b200_emulation,
    stricter_tier,
    tier_skip_reason,
)

#: Marker of tests whose subject is real FlashInfer compared with the emulator (skipped when emulated).
REAL_FLASHINFER_MARKER = "needs_real_flashinfer"
EMULATED_REAL_FLASHINFER_REASON = (
    "compares real FlashInfer with the emulator; under --flashinfer-emulated both sides would be the emulator"
)
_OWN_TIER = pytest.StashKey[str]()  # the tier a test had before its backend's was applied


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("nvfp4", "NVFP4 W4A16 conformance")
    group.addoption(
        "--flashinfer-emulated",
        action="store_true",
        default=False,
        help="rehearse the b200 tier anywhere: FlashInfer's W4A16 entry points are routed to "
        "reference_impl.flashinfer_emulator and the capability check answers SM100; reports mark the run "
        "'emulated' (never a B200 result)",
    )


def pytest_configure(config: pytest.Config) -> None:
    _share_cpu_threads_between_xdist_workers()
    if config.getoption("--flashinfer-emulated", default=False):
        set_b200_emulation(True)
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: hardware tier, {TIER_DESCRIPTIONS[tier]}")
    config.addinivalue_line(
        "markers", f"{REAL_FLASHINFER_MARKER}: the test compares real FlashInfer with the emulator "
        "(skipped under --flashinfer-emulated)",
    )


def pytest_report_header(config: pytest.Config) -> str:
    header = f"nvfp4 conformance hardware: {detect_hardware().describe()}"
    if b200_emulated():
        header += "; b200 tier EMULATED (--flashinfer-emulated: FlashInfer routed to the emulator, not a B200 result)"
    return header


def tier_of(item: pytest.Item) -> str:
    """The item's tier marker (``cpu`` when it has none)."""
    return next((t for t in TIERS if item.get_closest_marker(t) is not None), "cpu")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test parametrized by a backend needs the stricter of its own tier and the backend's ``tier``:
    its tier marker is replaced accordingly (test ids do not change)."""
    for item in items:
        own = item.stash[_OWN_TIER] = tier_of(item)
        backend = getattr(getattr(item, "callspec", None), "params", {}).get("backend")
        needed = getattr(backend, "tier", "cpu")
        try:
            effective = stricter_tier(own, needed)
        except ValueError as exc:
            item.add_marker(pytest.mark.skip(reason=f"backend {backend.name!r} needs {needed}, case needs {own}: {exc}"))
            continue
        if effective != own:
            item.own_markers[:] = [m for m in item.own_markers if m.name not in TIERS]
            item.add_marker(getattr(pytest.mark, effective))


def pytest_runtest_setup(item: pytest.Item) -> None:
    hw = detect_hardware()
    for tier in TIERS:
        if item.get_closest_marker(tier) is not None:
            reason = _emulated_b200_reason(item, hw) if tier == "b200" and b200_emulated() else tier_skip_reason(tier, hw)
            if reason:
                pytest.skip(f"[{tier}] {reason}")


def _emulated_b200_reason(item: pytest.Item, hw) -> str | None:
    """Under emulation the ``b200`` tier runs on this host's device; a test still needs what its own case
    needs (a ``cuda`` case needs a CUDA GPU), and real-vs-emulator comparisons cannot run at all."""
    if item.get_closest_marker(REAL_FLASHINFER_MARKER) is not None:
        return EMULATED_REAL_FLASHINFER_REASON
    own = item.stash.get(_OWN_TIER, "b200")
    reason = tier_skip_reason("cpu" if own == "b200" else own, hw)
    return None if reason is None else f"emulated b200 on this host, but the case itself {reason}"


def _share_cpu_threads_between_xdist_workers() -> None:
    """Each pytest-xdist worker is a process with torch's full intra-op thread pool; n workers on n cores
    would run n*n threads and thrash. Give each worker its share, unless the user set OMP_NUM_THREADS."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers or "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))
