"""Tier detection and skip reasons, on made-up hardware."""
import pytest

from conformance.tiers import Gpu, Hardware, tier_skip_reason

H200 = Gpu("NVIDIA H200", (9, 0))
B200 = Gpu("NVIDIA B200", (10, 0))
CASES = [
    # (tier, hardware, expected reason or None)
    ("cpu", Hardware(), None),
    ("cuda", Hardware(), "needs a CUDA GPU, found no CUDA GPU (CPU only)"),
    ("cuda", Hardware((H200,)), None),
    ("sm90", Hardware((H200,)), None),
    ("sm90", Hardware((B200,)), "needs SM90, found SM100 (NVIDIA B200)"),
    ("b200", Hardware((H200,)), "needs SM100/SM103, found SM90 (NVIDIA H200)"),
    ("b200", Hardware((B200,)), None),
    ("b200", Hardware((Gpu("NVIDIA B300", (10, 3)),)), None),
    ("b200", Hardware((Gpu("RTX PRO 6000", (12, 0)),)), "needs SM100/SM103, found SM120 (RTX PRO 6000)"),
    ("multi_gpu", Hardware((H200,)), "needs 2+ CUDA GPUs, found SM90 (NVIDIA H200)"),
    ("multi_gpu", Hardware((H200, H200)), None),
    ("b200_4gpu", Hardware((H200,) * 4), "needs 4 SM100/SM103 GPUs, found 4 x SM90 (NVIDIA H200)"),
    ("b200_4gpu", Hardware((B200,) * 3), "needs 4 SM100/SM103 GPUs, found 3 x SM100 (NVIDIA B200)"),
    ("b200_4gpu", Hardware((B200,) * 4), None),
]


@pytest.mark.parametrize("tier,hw,expected", CASES, ids=[f"{c[0]}-{c[1].describe()}" for c in CASES])
def test_tier_skip_reason(tier, hw, expected):
    assert tier_skip_reason(tier, hw) == expected


def test_unknown_tier_is_an_error():
    with pytest.raises(ValueError, match="unknown hardware tier 'h100'"):
        tier_skip_reason("h100", Hardware())
