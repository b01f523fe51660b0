"""``--truth-device``: parsed and checked at start (an unusable device is a usage error before any server), and
the device chosen reaches the truth (:class:`reference_impl.truth.engine.TruthModel`) for a user's checkpoint
(the golden outputs computed at session start) and for the on-demand answers of every model."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import reference_impl.truth.golden as golden_module
from conformance.server.models import ModelCatalog, ServedModel, ensure_fixture_root
from reference_impl.truth.engine import default_device, resolve_device

REPO = Path(__file__).resolve().parents[2]


class _Reached(Exception):
    pass


@pytest.fixture
def recorded(monkeypatch):
    """TruthModel replaced by a recorder of the device it is given (stops there)."""
    seen: list = []

    def fake(path, device=None, cache_bytes=None):
        seen.append((Path(path).name, device))
        raise _Reached

    monkeypatch.setattr(golden_module, "TruthModel", fake)
    return seen


def test_default_device():
    assert default_device() == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(None) == torch.device(default_device())
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("bad,why", [("tpu", "is not a torch device"), ("meta", "the truth runs on cuda or cpu")]
                         + ([("cuda", "CUDA is not available")] if not torch.cuda.is_available() else []))
def test_unusable_device_refused(bad, why):
    with pytest.raises(ValueError, match=why):
        resolve_device(bad)


def test_user_checkpoint_truth_runs_on_the_device_given(recorded, monkeypatch, tmp_path):
    monkeypatch.setenv("NVFP4_SERVER_WORK_DIR", str(tmp_path))
    src = ensure_fixture_root(None) / "dense-nvfp4_awq-a"
    catalog = ModelCatalog([], None, [str(src)], None, truth_device="cpu")
    model = ServedModel("ckpt0-x", str(src), str(src), str(src), "", str(src / "tokenizer.json"), user=True)
    with pytest.raises(_Reached):
        catalog.truth(model, "a")  # the golden outputs, computed at session start
    assert recorded == [("dense-nvfp4_awq-a", "cpu")]


def test_fixture_truth_answers_on_the_device_given(recorded):
    catalog = ModelCatalog(["dense-nvfp4_awq"], None, [], None, truth_device="cpu")
    truth = catalog.truth(catalog.served("dense-nvfp4_awq"), "b")  # the snapshot: no truth computed yet
    assert recorded == [] and truth.device == "cpu"
    with pytest.raises(_Reached):
        truth.exact()  # the on-demand gaps, branches and teacher-forced paths
    assert recorded == [("dense-nvfp4_awq-b", "cpu")]


def test_option_in_help_and_checked_at_start():
    cmd = [sys.executable, "-m", "pytest", "conformance/server/test_server_scenarios.py", "-p", "no:cacheprovider"]
    r = subprocess.run(cmd + ["--help"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert "--truth-device" in r.stdout and "default: cuda if available, else cpu" in " ".join(r.stdout.split())
    r = subprocess.run(cmd + ["--collect-only", "-q", "--truth-device", "meta"], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 4 and "--truth-device: 'meta': the truth runs on cuda or cpu" in r.stderr, r.stderr[-2000:]
