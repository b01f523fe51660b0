"""Tier detection and skip reasons, on made-up hardware; the stricter-tier rule and b200 emulation.
Imports conformance._framework: it tests the framework itself."""
import pytest
import torch

from conformance._framework import tiers
from conformance._framework.tiers import Gpu, Hardware, stricter_tier, tier_skip_reason
from conformance.interfaces import hardware

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


STRICTER = [
    ("cpu", "cpu", "cpu"), ("cpu", "b200", "b200"), ("cuda", "b200", "b200"), ("b200", "cuda", "b200"),
    ("cpu", "cuda", "cuda"), ("multi_gpu", "b200", "b200_4gpu"), ("b200_4gpu", "b200", "b200_4gpu"),
    ("sm90", "cuda", "sm90"),
]


@pytest.mark.parametrize("a,b,expected", STRICTER, ids=[f"{a}+{b}" for a, b, _ in STRICTER])
def test_stricter_tier(a, b, expected):
    """A test's tier is the stricter of its case's and its backend's: the least demanding tier offering both."""
    assert stricter_tier(a, b) == expected == stricter_tier(b, a)


@pytest.mark.parametrize("a,b", [("sm90", "b200"), ("sm90", "multi_gpu")])
def test_no_tier_offers_both_is_an_error(a, b):
    with pytest.raises(ValueError, match=f"no hardware tier offers both '{a}' and '{b}'"):
        stricter_tier(a, b)


def test_b200_emulation_runs_on_this_hosts_device(monkeypatch):
    """--flashinfer-emulated: the b200 tier's cases run on CUDA when there is one, else on the CPU; nothing else
    changes device. Without emulation b200 cases always target CUDA. (The switch is
    conformance.interfaces.hardware's, which tiers re-exports: it is patched there.)"""
    monkeypatch.setattr(hardware, "_b200_emulation", [])
    monkeypatch.delenv(tiers.B200_EMULATION_ENV_VAR, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not tiers.b200_emulated() and tiers.device_for_tier("b200") == "cuda"
    tiers.set_b200_emulation(True)
    assert tiers.b200_emulated() and tiers.device_for_tier("b200") == "cpu"
    assert tiers.device_for_tier("cuda") == "cuda" and tiers.device_for_tier("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert tiers.device_for_tier("b200") == "cuda"
    monkeypatch.setattr(hardware, "_b200_emulation", [])
    monkeypatch.setenv(tiers.B200_EMULATION_ENV_VAR, "1")
    assert tiers.b200_emulated()
    assert tiers.b200_emulated is hardware.b200_emulated and tiers.Gpu is hardware.Gpu


def test_flashinfer_cases_take_the_b200_tier_and_keep_their_ids():
    from conformance.adapters.flashinfer.kernel import FlashInferBackend
    from conformance.adapters.reference.kernel import ReferenceBackend
    from conformance._framework.cases import case_for_backend
    from conformance.dense.cases import CPU_CASES

    case = CPU_CASES[0]
    assert case_for_backend(case, ReferenceBackend()) is case
    moved = case_for_backend(case, FlashInferBackend(None, unavailable="not here"))
    assert (moved.tier, moved.id, moved.seed) == ("b200", case.id, case.seed)


def test_tier_skips_are_reported_at_the_test(tmp_path):
    """A tier the machine lacks skips the test by a marker, so `-rs` names the test's own file and line, not the
    tier plugin's (issue 37: every skip line pointed at conformance/_framework/tier_markers.py)."""
    import subprocess
    import sys
    from pathlib import Path

    from conformance._framework.tiers import TIERS, detect_hardware, tier_skip_reason

    lacking = [t for t in TIERS if tier_skip_reason(t, detect_hardware())]
    if not lacking:
        pytest.skip("this machine offers every tier: no tier skip to show")
    tier = lacking[-1]
    test = tmp_path / "test_needs_tier.py"
    test.write_text(f"import pytest\n\n@pytest.mark.{tier}\ndef test_needs_tier():\n    pass\n")
    repo = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "pytest", str(test), "-p", "conformance.plugin", "-rs", "-q",
                        "-p", "no:cacheprovider", "--rootdir", str(tmp_path)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(repo)})
    skips = [line for line in r.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skips) == 1 and f"[{tier}] needs" in skips[0], r.stdout[-2000:]
    assert "test_needs_tier.py" in skips[0] and "tier_markers.py" not in skips[0], skips[0]
