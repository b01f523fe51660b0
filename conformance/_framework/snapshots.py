"""Golden snapshots of tensors (syrupy), stored under ``fixtures/snapshots/<test module>/<test name>.tensors.json``.

A snapshot is a named set of entries (see docs/snapshots.md):

* integer / bool / float8 tensors (codes, scale bytes): compared **exactly**, byte for byte;
* float tensors: stored **losslessly** (their raw little-endian bytes in hex, plus ``float.hex`` of the first
  values for the reader) and compared within the tolerance the snapshot file records. Wrap a float tensor in
  :class:`Approx` to give the tolerance and its derivation; a bare float tensor is recorded with tolerance 0.
  Changing the tolerance in the test is itself a mismatch until the snapshot is regenerated;
* strings and ints (a seed, a recipe name, a hash of the inputs): compared exactly.

``pytest --snapshot-update`` rewrites the files; otherwise any difference fails the test. The directory is the
shipped data's (:mod:`conformance._framework.data`: a clone's fixtures/snapshots/ or the installed package's); the
environment variable ``NVFP4_SNAPSHOT_DIR`` moves it (used by the self-tests to work in a temporary folder).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from syrupy.extensions.single_file import SingleFileSnapshotExtension, WriteMode

from conformance._framework.data import data_path

SNAPSHOT_FORMAT = "nvfp4-conformance-tensors/1"
SNAPSHOT_DIR_ENV = "NVFP4_SNAPSHOT_DIR"
DEFAULT_SNAPSHOT_ROOT = data_path("snapshots")
_BYTES_PER_LINE = 32
_PREVIEW_VALUES = 8

_EXACT_DTYPES = {
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
    torch.float8_e4m3fn, torch.float8_e5m2,
}
_FLOAT_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
_DTYPES = {str(d).removeprefix("torch."): d for d in _EXACT_DTYPES | _FLOAT_DTYPES}


@dataclass(frozen=True)
class Approx:
    """A float tensor compared within ``|got - want| <= atol + rtol * |want|`` (NaN must match NaN).
    ``why`` holds the derivation of the tolerance; it is written into the snapshot next to the numbers."""

    tensor: torch.Tensor
    rtol: float
    atol: float
    why: str

    def __post_init__(self) -> None:
        if self.tensor.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"Approx is for float tensors, got {self.tensor.dtype}")
        if not (self.rtol >= 0 and self.atol >= 0):
            raise ValueError(f"tolerances must be >= 0, got rtol={self.rtol}, atol={self.atol}")


def snapshot_root() -> Path:
    return Path(os.environ.get(SNAPSHOT_DIR_ENV, DEFAULT_SNAPSHOT_ROOT))


def missing_golden_message(path: Path) -> str:
    """What a user who lacks a golden file is told: where the data comes from, never to make it themselves
    (golden truth regenerated from the implementation under test would pass anything)."""
    return (f"golden data {path} is missing from this install: it ships with the suite (fixtures/snapshots/, in a "
            f"clone and in the installed package alike); reinstall the suite (`pip install .`) or restore the "
            f"clone's fixtures/snapshots/, or set {SNAPSHOT_DIR_ENV} to a copy of that directory. Do not generate it "
            f"yourself: golden data made from the implementation under test would pass anything")


# ----------------------------------------------------------------------------------------- serialization
def serialize_entries(entries: Mapping[str, Any]) -> str:
    """The snapshot text of ``entries`` (name -> tensor | Approx | str | int)."""
    if not isinstance(entries, Mapping) or not entries:
        raise TypeError("a tensor snapshot is a non-empty mapping of name -> tensor | Approx | str | int")
    out = {}
    for name, value in entries.items():
        if not isinstance(name, str):
            raise TypeError(f"snapshot entry names must be strings, got {name!r}")
        out[name] = _serialize_entry(name, value)
    text = json.dumps({"format": SNAPSHOT_FORMAT, "entries": out}, indent=1)
    # Lists of plain numbers (shapes) on one line; hex lines stay one per line for readable diffs.
    return re.sub(r"\[([-\d,\s]*)\]", _one_line, text) + "\n"


def _one_line(match: re.Match) -> str:
    return "[" + ", ".join(item.strip() for item in match.group(1).split(",") if item.strip()) + "]"


def _serialize_entry(name: str, value: Any) -> dict:
    if isinstance(value, Approx):
        entry = _tensor_record(value.tensor)
        entry.update(compare="allclose", rtol=value.rtol, atol=value.atol, why=value.why)
        return entry
    if isinstance(value, torch.Tensor):
        entry = _tensor_record(value)
        if value.dtype in _FLOAT_DTYPES:  # a bare float tensor: exact unless wrapped in Approx
            entry.update(compare="allclose", rtol=0.0, atol=0.0, why="no tolerance given: exact")
        else:
            entry["compare"] = "exact"
        return entry
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return {"compare": "exact", "value": value}
    raise TypeError(f"snapshot entry {name!r}: cannot store a {type(value).__name__} (use a tensor, Approx, str or int)")


def _tensor_record(t: torch.Tensor) -> dict:
    if t.dtype not in _EXACT_DTYPES | _FLOAT_DTYPES:
        raise TypeError(f"unsupported tensor dtype {t.dtype} for a snapshot")
    t = t.detach().cpu().contiguous()
    raw = _raw_bytes(t)
    record = {
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "byteorder": "little",
        "hex": [raw[i:i + _BYTES_PER_LINE].hex() for i in range(0, len(raw), _BYTES_PER_LINE)],
    }
    if t.dtype in _FLOAT_DTYPES:
        record["first_values"] = [float(v).hex() for v in t.reshape(-1)[:_PREVIEW_VALUES].double().tolist()]
    return record


def _raw_bytes(t: torch.Tensor) -> bytes:
    if sys.byteorder != "little":  # torch stores native order; the files are little-endian
        raise RuntimeError("tensor snapshots are written on little-endian machines only")
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else flat.to(torch.uint8).numpy().tobytes()


def _tensor_from_record(record: dict) -> torch.Tensor:
    dtype = _DTYPES[record["dtype"]]
    raw = bytearray(bytes.fromhex("".join(record["hex"])))
    data = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    if dtype == torch.bool:
        return data.to(torch.bool).reshape(record["shape"])
    return data.view(dtype).reshape(record["shape"])


def load_snapshot(path: Path) -> dict[str, Any]:
    """The entries of a stored snapshot file: tensors (exactly as stored), strings and ints. For tests that
    judge a backend against golden data without re-creating it (``conformance/dense/test_dense_golden.py``)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError as exc:
        raise FileNotFoundError(missing_golden_message(path)) from exc
    try:
        return deserialize_entries(text)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def tensors_sha256(tensors: Iterable[torch.Tensor | None]) -> str:
    """SHA-256 of the tensors' bytes in order (``None`` skipped): identifies a case's inputs in a snapshot."""
    h = hashlib.sha256()
    for t in tensors:
        if t is not None:
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def deserialize_entries(text: str) -> dict[str, Any]:
    """The entries of a snapshot text: tensors (float entries with their recorded values) and str/int values."""
    data = json.loads(text)
    if data.get("format") != SNAPSHOT_FORMAT:
        raise ValueError(f"snapshot format {data.get('format')!r}, expected {SNAPSHOT_FORMAT!r}")
    return {name: (e["value"] if "value" in e else _tensor_from_record(e).clone()) for name, e in data["entries"].items()}


# ----------------------------------------------------------------------------------------- comparison
def snapshot_differences(snapshot_text: str, received_text: str) -> list[str]:
    """Human-readable differences between a stored snapshot and a received one (empty list: they match).
    Exact entries must be identical; float entries within the *snapshot's* recorded tolerance."""
    try:
        want, got = json.loads(snapshot_text), json.loads(received_text)
    except json.JSONDecodeError as e:
        return [f"the stored snapshot is not valid JSON ({e}): it is damaged; restore fixtures/snapshots/ from the "
                f"repository (git checkout fixtures/snapshots)"]
    if want.get("format") != SNAPSHOT_FORMAT:
        return [f"snapshot format {want.get('format')!r}, expected {SNAPSHOT_FORMAT!r}"]
    w_entries, g_entries = want["entries"], got["entries"]
    diffs = []
    for name in w_entries.keys() - g_entries.keys():
        diffs.append(f"{name}: in the snapshot, missing from the result")
    for name in g_entries.keys() - w_entries.keys():
        diffs.append(f"{name}: new in the result, not in the snapshot")
    for name in w_entries.keys() & g_entries.keys():
        diffs += [f"{name}: {d}" for d in _entry_differences(w_entries[name], g_entries[name])]
    return sorted(diffs)


def _entry_differences(want: dict, got: dict) -> list[str]:
    if "value" in want or "value" in got:
        return [] if want.get("value") == got.get("value") else [f"value {got.get('value')!r} != {want.get('value')!r}"]
    for key in ("dtype", "shape", "compare"):
        if want[key] != got[key]:
            return [f"{key} {got[key]} != snapshot's {want[key]}"]
    if want["compare"] == "exact":
        return _exact_differences(_tensor_from_record(want), _tensor_from_record(got))
    diffs = []
    if (want["rtol"], want["atol"]) != (got["rtol"], got["atol"]):
        diffs.append(
            f"tolerance changed from rtol={want['rtol']}, atol={want['atol']} to rtol={got['rtol']}, "
            f"atol={got['atol']}: the test and its stored golden data disagree on the tolerance (maintainers: "
            f"docs/snapshots.md)"
        )
    return diffs + _close_differences(_tensor_from_record(want), _tensor_from_record(got), want["rtol"], want["atol"])


def _exact_differences(want: torch.Tensor, got: torch.Tensor) -> list[str]:
    w = want.view(torch.uint8) if want.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else want
    g = got.view(torch.uint8) if got.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else got
    bad = w != g
    if not bool(bad.any()):
        return []
    first = tuple(int(i) for i in bad.nonzero()[0])
    return [f"{int(bad.sum())} of {bad.numel()} elements differ; first at {first}: {g[first].item()} != {w[first].item()}"]


def _close_differences(want: torch.Tensor, got: torch.Tensor, rtol: float, atol: float) -> list[str]:
    w, g = want.double(), got.double()
    both_nan = torch.isnan(w) & torch.isnan(g)
    same = (w == g) | both_nan  # covers equal infinities
    bad = ~same & ~((g - w).abs() <= atol + rtol * w.abs())
    if not bool(bad.any()):
        return []
    first = tuple(int(i) for i in bad.nonzero()[0])
    return [
        f"{int(bad.sum())} of {bad.numel()} elements outside rtol={rtol}, atol={atol}; "
        f"first at {first}: {float(g[first]).hex()} vs snapshot {float(w[first]).hex()}"
    ]


# ----------------------------------------------------------------------------------------- syrupy extension
class TensorSnapshotExtension(SingleFileSnapshotExtension):
    """One ``.tensors.json`` file per snapshot under :func:`snapshot_root` / <test module name>."""

    _write_mode = WriteMode.TEXT
    file_extension = "tensors.json"

    @classmethod
    def dirname(cls, *, test_location) -> str:
        return str(snapshot_root() / test_location.basename)

    def serialize(self, data, **kwargs) -> str:
        return serialize_entries(data)

    def matches(self, *, serialized_data, snapshot_data) -> bool:
        if snapshot_data is None:
            return False
        return not snapshot_differences(snapshot_data, serialized_data)

    def diff_lines(self, serialized_data, snapshot_data) -> Iterator[str]:
        differences = snapshot_differences(snapshot_data, serialized_data) if snapshot_data else ["no snapshot"]
        yield from differences
        yield ("(the stored snapshot is the reference's golden data: a difference is a finding about the code that "
               "produced the result; it is regenerated only from the reference, by the suite's maintainers: "
               "docs/snapshots.md)")
