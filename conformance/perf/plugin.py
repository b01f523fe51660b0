"""The ``perf`` tier: the ``perf`` marker, the measurement fixtures, the printed perf table and the optional
gate file (``--perf-expectations``). See :mod:`conformance.perf.measure` and docs/perf.md.

Perf tests run only when selected (``pytest -m perf``): a conformance run skips them with that reason, so
their time never lands in a correctness gate. Their findings are flags, not failures, unless a
``--perf-expectations`` TOML file sets a limit for them::

    [[perf]]
    id = "conformance/perf/test_perf.py::test_dense_perf[mykernel-n4096-k4096-m1]"   # test-id prefix
    max_vs_bf16 = 1.0        # fail when slower than the BF16 baseline
    max_vs_floor = 3.0       # optional: fail when more than 3x the W4A16 floor
    reason = "our W4A16 GEMV must beat BF16 at decode sizes"
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conformance._framework.reporting import markdown_cell, register_section
from conformance.perf.measure import TABLE_HEADER, table_cells

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

PERF_PROPERTY = "perf"
_LIMITS = ("max_vs_bf16", "max_vs_floor")
_GATES_KEY = pytest.StashKey[list]()


@dataclass(frozen=True)
class PerfGate:
    id: str
    reason: str
    max_vs_bf16: float | None = None
    max_vs_floor: float | None = None

    def violations(self, row: dict[str, Any]) -> list[str]:
        out = []
        for limit in _LIMITS:
            bound = getattr(self, limit)
            measured = row[limit.removeprefix("max_")]
            if bound is not None and not measured <= bound:
                out.append(f"{limit.removeprefix('max_')} = {measured:.3f} > {bound} ({self.reason})")
        return out


def load_perf_gates(path: str | Path) -> list[PerfGate]:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise pytest.UsageError(f"cannot read perf expectations {path}: {exc}") from exc
    if set(data) - {"perf"}:
        raise pytest.UsageError(f"{path}: unknown section(s) {sorted(set(data) - {'perf'})}; use [[perf]]")
    gates = []
    for n, entry in enumerate(data.get("perf", []), 1):
        where = f"{path}: [[perf]] entry {n}"
        extra = set(entry) - {"id", "reason", *_LIMITS}
        if extra:
            raise pytest.UsageError(f"{where}: unknown key(s) {sorted(extra)}; allowed: id, reason, {', '.join(_LIMITS)}")
        if not isinstance(entry.get("id"), str) or not isinstance(entry.get("reason"), str) or not entry["reason"].strip():
            raise pytest.UsageError(f"{where}: 'id' and a non-empty 'reason' are required")
        limits = {k: entry[k] for k in _LIMITS if k in entry}
        if not limits or any(not isinstance(v, int | float) or v <= 0 for v in limits.values()):
            raise pytest.UsageError(f"{where}: give at least one positive limit of {', '.join(_LIMITS)}")
        gates.append(PerfGate(entry["id"], entry["reason"].strip(), **{k: float(v) for k, v in limits.items()}))
    return gates


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("nvfp4", "NVFP4 W4A16 conformance")
    group.addoption("--perf-expectations", default=None, metavar="FILE",
                    help="TOML [[perf]] limits (max_vs_bf16, max_vs_floor) that turn perf flags into failures")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "perf: performance measurement (the perf tier); runs only with -m perf")
    path = config.getoption("--perf-expectations")
    config.stash[_GATES_KEY] = load_perf_gates(path) if path else []


def perf_selected(config: pytest.Config) -> bool:
    return "perf" in (config.getoption("markexpr", "") or "")


PERF_NOT_SELECTED = "perf tier: measurements run only when selected (pytest -m perf)"


@pytest.hookimpl(trylast=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip a perf test the run did not select. At setup and last, so that a host lacking the test's tier
    (e.g. ``-m b200`` on a machine without SM100) reports that reason first, not this one."""
    if item.get_closest_marker("perf") is not None and not perf_selected(item.config):
        pytest.skip(PERF_NOT_SELECTED)


@pytest.fixture
def perf_gate(request: pytest.FixtureRequest):
    """``check(row_dict)``: fail the test when a ``--perf-expectations`` entry matching it is exceeded."""

    def check(row: dict[str, Any]) -> None:
        problems = [v for g in request.config.stash[_GATES_KEY] if request.node.nodeid.startswith(g.id)
                    for v in g.violations(row)]
        if problems:
            pytest.fail("perf expectation not met: " + "; ".join(problems), pytrace=False)

    return check


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "call":
        return
    for key, value in report.user_properties:
        if key == PERF_PROPERTY and isinstance(value, dict):
            _rows.append(value)


_rows: list[dict[str, Any]] = []  # the controller's rows (logreport hooks get no config)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if not _rows:
        return
    from conformance.perf.measure import TABLE_HEADER, table_cells

    tr = terminalreporter
    tr.section("nvfp4 perf tier")
    for line in sorted({r.get("yardsticks", "") for r in _rows} - {""}):
        tr.line(f"yardsticks: {line}")
    cells = [TABLE_HEADER] + [table_cells(r) for r in sorted(_rows, key=lambda r: (r["kind"], r["shape"], r["tokens"], r["backend"]))]
    widths = [max(len(c[i]) for c in cells) for i in range(len(TABLE_HEADER) - 1)]
    for c in cells:
        tr.line(" | ".join(v.rjust(w) for v, w in zip(c, widths)) + (" | " + c[-1] if c[-1] else ""))


def perf_section(tests: list[dict[str, Any]]) -> list[str]:
    """The report's perf table (tests that recorded a ``perf`` property; see :mod:`conformance.perf.measure`)."""
    rows = [t["properties"]["perf"] for t in tests if isinstance(t.get("properties", {}).get("perf"), dict)]
    if not rows:
        return []
    rows.sort(key=lambda r: (r["kind"], r["shape"], r["tokens"], r["backend"]))
    lines = ["", "## Performance", "",
             "Backend time per shape next to a BF16 baseline of the same shape and the W4A16 floor "
             "(bytes it must move / measured copy bandwidth, FLOPs / measured BF16 matmul rate), all measured in "
             "this run; flags are findings, not failures (docs/perf.md).", ""]
    lines += [f"- yardsticks: {y}" for y in sorted({str(r.get("yardsticks", "")) for r in rows} - {""})]
    lines += [f"- baseline: {b}" for b in sorted({str(r.get("baseline", "")) for r in rows} - {""})]
    lines += ["", "| " + " | ".join(TABLE_HEADER) + " |", "|" + " --- |" * 3 + " ---: |" * 7 + " --- |"]
    lines += ["| " + " | ".join(markdown_cell(c) for c in table_cells(r)) + " |" for r in rows]
    return lines


register_section(perf_section)
