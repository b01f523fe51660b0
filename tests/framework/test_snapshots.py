"""The tensor snapshot extension (conformance/_framework/snapshots.py): lossless storage, exact integers, recorded float
tolerance, and a changed value failing until ``--snapshot-update`` regenerates the snapshot.
Imports conformance._framework: it tests the framework itself."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch

from conformance.format import inputs as I
from conformance._framework.snapshots import (
    DEFAULT_SNAPSHOT_ROOT,
    SNAPSHOT_DIR_ENV,
    Approx,
    TensorSnapshotExtension,
    serialize_entries,
    snapshot_differences,
)
from reference_impl.format import nvfp4 as F

pytest_plugins = ["pytester"]

_TOL = dict(rtol=1e-6, atol=1e-6, why="demo tolerance")


def _awkward_floats(dtype: torch.dtype) -> torch.Tensor:
    # -0, a subnormal, the largest finite, inf, NaN: a lossless format must keep every one bit for bit
    vals = torch.tensor([0.0, -0.0, 1.5, -2.25, float("inf"), float("-inf"), float("nan")], dtype=torch.float64)
    t = vals.to(dtype)
    info = torch.finfo(dtype)
    return torch.cat([t, torch.tensor([info.tiny / 4, info.max, -info.min / 2], dtype=torch.float64).to(dtype)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_float_tensors_round_trip_bit_for_bit(dtype):
    t = _awkward_floats(dtype)
    text = serialize_entries({"t": t})
    record = json.loads(text)["entries"]["t"]
    stored = bytes.fromhex("".join(record["hex"]))
    assert stored == t.view(torch.uint8).numpy().tobytes()
    assert snapshot_differences(text, serialize_entries({"t": t.clone()})) == []


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn])
def test_exact_tensors_one_element_off_fails(dtype):
    base = torch.arange(40, dtype=torch.int64).view(5, 8) % (2 if dtype == torch.bool else 100)
    want = base.to(torch.uint8).view(torch.float8_e4m3fn) if dtype == torch.float8_e4m3fn else base.to(dtype)
    got = want.clone()
    raw = got.view(torch.uint8) if dtype == torch.float8_e4m3fn else got
    raw[3, 2] = (raw[3, 2] == 0) if dtype == torch.bool else raw[3, 2] + 1
    text = serialize_entries({"x": want})
    assert snapshot_differences(text, serialize_entries({"x": want.clone()})) == []
    diffs = snapshot_differences(text, serialize_entries({"x": got}))
    assert len(diffs) == 1 and "1 of 40 elements differ; first at (3, 2)" in diffs[0], diffs


def test_float_within_recorded_tolerance_passes_outside_fails():
    y = torch.linspace(-1, 1, 9)
    text = serialize_entries({"y": Approx(y, **_TOL)})
    assert snapshot_differences(text, serialize_entries({"y": Approx(y + 5e-7, **_TOL)})) == []
    diffs = snapshot_differences(text, serialize_entries({"y": Approx(y + 1e-4, **_TOL)}))
    assert diffs and "outside rtol=1e-06, atol=1e-06" in diffs[0]
    nan = y.clone()
    nan[4] = float("nan")
    assert snapshot_differences(text, serialize_entries({"y": Approx(nan, **_TOL)})), "NaN never matches a number"


def test_tolerance_is_the_snapshots_and_changing_it_needs_regeneration():
    y = torch.linspace(-1, 1, 9)
    text = serialize_entries({"y": Approx(y, **_TOL)})
    assert json.loads(text)["entries"]["y"]["rtol"] == 1e-6  # recorded in the file
    loose = dict(_TOL, rtol=1.0)
    diffs = snapshot_differences(text, serialize_entries({"y": Approx(y + 1e-3, **loose)}))
    assert any("tolerance changed" in d for d in diffs) and any("outside rtol=1e-06" in d for d in diffs)


_BASE = {"codes": torch.zeros(4, dtype=torch.uint8), "note": "a"}


@pytest.mark.parametrize(
    "received",
    [
        {"codes": torch.zeros(4, dtype=torch.int32), "note": "a"},
        {"codes": torch.zeros(2, 2, dtype=torch.uint8), "note": "a"},
        {**_BASE, "extra": "x"},
        {"note": "a"},
        {**_BASE, "note": "b"},
    ],
    ids=["dtype", "shape", "new-entry", "missing-entry", "string-value"],
)
def test_structure_changes_fail(received):
    assert snapshot_differences(serialize_entries(_BASE), serialize_entries(received))


def test_bad_entries_are_clear_errors():
    with pytest.raises(TypeError, match="cannot store a list"):
        serialize_entries({"x": [1, 2]})
    with pytest.raises(TypeError, match="Approx is for float tensors"):
        Approx(torch.zeros(2, dtype=torch.uint8), 0, 0, "")
    with pytest.raises(ValueError, match="tolerances must be >= 0"):
        Approx(torch.zeros(2), -1, 0, "")


def test_stored_canonical_snapshot_rejects_a_one_code_change():
    """The committed golden file of the kernel recipe against the current reference with one code flipped."""
    path = DEFAULT_SNAPSHOT_ROOT / "test_format" / "test_canonical_vectors[kernel].tensors.json"
    stored = path.read_text()
    entries = json.loads(stored)["entries"]
    w = I.canonical_weight()
    global_sf = (F.E2M1_MAX * F.E4M3_MAX) / w.float().abs().amax()
    packed, sf = F.quantize_kernel(w, global_sf)
    received = {
        "weight": entries["weight"]["value"], "weight_sha256": entries["weight_sha256"]["value"],
        "global_sf": Approx(global_sf, rtol=entries["global_sf"]["rtol"], atol=entries["global_sf"]["atol"],
                            why=entries["global_sf"]["why"]),
        "packed": packed, "block_scale_swizzled": F.swizzle_128x4(sf).view(torch.uint8),
    }
    extension = TensorSnapshotExtension()
    assert extension.matches(serialized_data=serialize_entries(received), snapshot_data=stored)
    received["packed"] = packed.clone()
    received["packed"][100, 7] ^= 0x01
    assert not extension.matches(serialized_data=serialize_entries(received), snapshot_data=stored)
    assert snapshot_differences(stored, serialize_entries(received)) == [
        "packed: 1 of 65536 elements differ; first at (100, 7): "
        f"{int(received['packed'][100, 7])} != {int(packed[100, 7])}"
    ]


_DEMO_TEST = """
import os
import torch
from conformance._framework.snapshots import Approx

def test_vectors(golden):
    codes = torch.arange(32, dtype=torch.uint8)
    y = torch.linspace(-1, 1, 8)
    change = os.environ.get("DEMO_CHANGE", "")
    if change == "code":
        codes[5] ^= 1
    if change == "float-small":
        y = y + 1e-7
    if change == "float-large":
        y = y + 1e-3
    assert golden == {"codes": codes, "y": Approx(y, rtol=1e-6, atol=1e-6, why="demo")}
"""


def test_changed_value_fails_until_regenerated(pytester, monkeypatch, tmp_path):
    """End to end through syrupy: generate, pass, change -> fail, regenerate on purpose -> pass."""
    snapshot_dir = tmp_path / "snapshots"
    monkeypatch.setenv(SNAPSHOT_DIR_ENV, str(snapshot_dir))
    pytester.makepyfile(test_demo=textwrap.dedent(_DEMO_TEST))
    # Only the plugins this needs (auto-loading every installed pytest plugin costs seconds per run).
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    args = ["-p", "syrupy", "-p", "conformance._framework.snapshot_fixture", "-p", "no:cacheprovider", "-q"]

    def run(change: str, *extra: str):
        monkeypatch.setenv("DEMO_CHANGE", change)
        return pytester.runpytest(*args, *extra)

    run("", "--snapshot-update").assert_outcomes(passed=1)
    assert (snapshot_dir / "test_demo" / "test_vectors.tensors.json").is_file()
    run("").assert_outcomes(passed=1)
    run("float-small").assert_outcomes(passed=1)  # 1e-7 is inside the recorded tolerance
    failed = run("code")
    failed.assert_outcomes(failed=1)
    failed.stdout.fnmatch_lines(["*codes: 1 of 32 elements differ; first at (5,): 4 != 5*"])
    run("float-large").assert_outcomes(failed=1)
    run("code", "--snapshot-update").assert_outcomes(passed=1)  # regenerated on purpose
    run("code").assert_outcomes(passed=1)
    run("").assert_outcomes(failed=1)  # and now the old value is the change
