"""Tier markers: register them, give each backend-parametrized test the stricter of its case's and its
backend's tier, and skip tests whose tier this machine lacks, with the reason. ``--flashinfer-emulated``
emulates the ``b200`` tier (see :mod:`conformance._framework.tiers`)."""
from __future__ import annotations

import functools
import os

import pytest

from conformance._framework.tiers import (
    TIER_DESCRIPTIONS,
    NoTierOffersBoth,
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
_HOST_TIER = pytest.StashKey[str]()  # what a test needs besides b200 (its case's tier): checked when emulated


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
    """The item's tier: the stricter of its tier markers (``cpu`` when it has none)."""
    return functools.reduce(stricter_tier, (t for t in TIERS if item.get_closest_marker(t) is not None), "cpu")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test keeps exactly one tier marker: the stricter of its own markers (a case's tier and a
    function-level one) and, for a test parametrized by a backend, the backend's ``tier``. Test ids do not
    change. What the test needs besides ``b200`` is kept for the emulated run."""
    for item in items:
        backend = getattr(getattr(item, "callspec", None), "params", {}).get("backend")
        marked = [t for t in TIERS if item.get_closest_marker(t) is not None]
        try:
            item.stash[_HOST_TIER] = functools.reduce(stricter_tier, (t for t in marked if t != "b200"), "cpu")
            effective = stricter_tier(tier_of(item), getattr(backend, "tier", "cpu"))
        except NoTierOffersBoth as exc:  # an unknown tier is a bug and propagates
            item.add_marker(pytest.mark.skip(reason=f"no machine offers what this test needs: {exc}"))
            continue
        if marked != [effective]:
            # The item's own markers (function decorators, its parametrization); a tier marker on a class or
            # module is shared with other tests and stays (-m then sees both).
            item.own_markers[:] = [m for m in item.own_markers if m.name not in TIERS]
            item.add_marker(getattr(pytest.mark, effective))
        # skipped by a marker, not from a hook: pytest then reports the test's own file and line (a skip raised in
        # pytest_runtest_setup is reported at this module's line, for every test alike)
        reason = _tier_skip(item)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


def _tier_skip(item: pytest.Item) -> str | None:
    hw = detect_hardware()
    for tier in TIERS:
        if item.get_closest_marker(tier) is not None:
            reason = _emulated_b200_reason(item, hw) if tier == "b200" and b200_emulated() else tier_skip_reason(tier, hw)
            if reason:
                return f"[{tier}] {reason}"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    reason = _tier_skip(item)  # a tier marker added after collection (by another plugin) is still honoured
    if reason:
        pytest.skip(reason)


def _emulated_b200_reason(item: pytest.Item, hw) -> str | None:
    """Under emulation the ``b200`` tier runs on this host's device; a test still needs what its own case
    needs (a ``cuda`` case needs a CUDA GPU), and real-vs-emulator comparisons cannot run at all."""
    if item.get_closest_marker(REAL_FLASHINFER_MARKER) is not None:
        return EMULATED_REAL_FLASHINFER_REASON
    reason = tier_skip_reason(item.stash.get(_HOST_TIER, "cpu"), hw)
    return None if reason is None else f"emulated b200 on this host, but the case itself {reason}"


def _share_cpu_threads_between_xdist_workers() -> None:
    """Each pytest-xdist worker is a process with torch's full intra-op thread pool; n workers on n cores
    would run n*n threads and thrash. Give each worker its share, unless the user set OMP_NUM_THREADS, and
    pass the share on (``OMP_NUM_THREADS``) to the processes a worker starts (servers, nested pytest runs),
    which would otherwise each start a full pool of their own."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers or "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    share = max(1, (os.cpu_count() or 1) // int(workers))
    torch.set_num_threads(share)
    os.environ["OMP_NUM_THREADS"] = str(share)
