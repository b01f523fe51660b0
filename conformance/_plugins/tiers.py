"""Tier markers: register them and skip tests whose tier this machine lacks, with the reason."""
from __future__ import annotations

import pytest

import os

from ..tiers import TIER_DESCRIPTIONS, TIERS, detect_hardware, tier_skip_reason


def pytest_configure(config: pytest.Config) -> None:
    _share_cpu_threads_between_xdist_workers()
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: hardware tier, {TIER_DESCRIPTIONS[tier]}")


def pytest_report_header(config: pytest.Config) -> str:
    return f"nvfp4 conformance hardware: {detect_hardware().describe()}"


def pytest_runtest_setup(item: pytest.Item) -> None:
    hw = detect_hardware()
    for tier in TIERS:
        if item.get_closest_marker(tier) is not None:
            reason = tier_skip_reason(tier, hw)
            if reason:
                pytest.skip(f"[{tier}] {reason}")


def _share_cpu_threads_between_xdist_workers() -> None:
    """Each pytest-xdist worker is a process with torch's full intra-op thread pool; n workers on n cores
    would run n*n threads and thrash. Give each worker its share, unless the user set OMP_NUM_THREADS."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers or "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))
