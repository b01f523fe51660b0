"""Tier markers: register them and skip tests whose tier this machine lacks, with the reason."""
from __future__ import annotations

import pytest

from ..tiers import TIER_DESCRIPTIONS, TIERS, detect_hardware, tier_skip_reason


def pytest_configure(config: pytest.Config) -> None:
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
