#!/usr/bin/env python3
"""Time the self-tests' CPU tier and print the time per test file, in two runs with a budget each.

Runs ``python -m pytest tests -n 2`` restricted to the CPU tier (every GPU tier marker deselected) twice: the unit
self-tests (``not integration``: the reference against its oracles, every check against its mutants, in process)
and the integration self-tests (marker ``integration``: they start reference and mutant servers or whole
pytest/gate runs, so each costs seconds of process start-up). Each run records a JUnit XML report and prints one
row per test file: tests, passed/failed/skipped, and the seconds its tests took (setup + call + teardown, summed
over the xdist workers), then the run's wall time. Exits non-zero when a run's wall time exceeds its budget, when a
test fails, or when nothing was collected.

    python ci/time_tests.py                               # budgets: unit 120 s, integration 360 s
    python ci/time_tests.py --only unit --budget 60 -- -k oracles
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPU_TIERS = ("cuda", "sm90", "b200", "multi_gpu", "b200_4gpu")
CPU_TIER_EXPRESSION = "not (" + " or ".join(GPU_TIERS) + ")"


@dataclass
class FileTiming:
    tests: int = 0
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0


def parse_junit(path: Path) -> dict[str, FileTiming]:
    """Per-file totals from a JUnit XML written with ``junit_family=xunit1`` (which records each test's file)."""
    per_file: dict[str, FileTiming] = defaultdict(FileTiming)
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("file") or _file_from_classname(case.get("classname", ""))
        row = per_file[name]
        row.tests += 1
        row.seconds += float(case.get("time", 0.0))
        if case.find("failure") is not None or case.find("error") is not None:
            row.failed += 1
        elif case.find("skipped") is not None:
            row.skipped += 1
        else:
            row.passed += 1
    return dict(per_file)


def _file_from_classname(classname: str) -> str:
    parts = classname.split(".")
    for n in range(len(parts), 0, -1):  # "tests.dense.test_x.TestClass" -> tests/dense/test_x.py
        candidate = "/".join(parts[:n]) + ".py"
        if (REPO / candidate).is_file():
            return candidate
    return classname or "<unknown>"


def format_table(per_file: dict[str, FileTiming], wall: float, workers: int) -> str:
    header = f"{'test file':<44} {'tests':>6} {'pass':>6} {'fail':>5} {'skip':>5} {'seconds':>9}"
    lines = [header, "-" * len(header)]
    for name, row in sorted(per_file.items(), key=lambda kv: -kv[1].seconds):
        lines.append(f"{name:<44} {row.tests:>6} {row.passed:>6} {row.failed:>5} {row.skipped:>5} {row.seconds:>9.2f}")
    total = FileTiming()
    for row in per_file.values():
        for f in ("tests", "passed", "failed", "skipped"):
            setattr(total, f, getattr(total, f) + getattr(row, f))
        total.seconds += row.seconds
    lines.append("-" * len(header))
    lines.append(f"{'sum over files':<44} {total.tests:>6} {total.passed:>6} {total.failed:>5} {total.skipped:>5} "
                 f"{total.seconds:>9.2f}")
    lines.append(f"{f'wall time of the run (-n {workers}, incl. start-up)':<72} {wall:>9.2f}")
    return "\n".join(lines)


RUNS = {"unit": "not integration", "integration": "integration"}


def run_once(kind: str, budget: float, args: argparse.Namespace) -> list[str]:
    """One pytest run of the ``kind`` self-tests; the problems found (empty: within budget and green)."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = (args.junit.with_name(f"{args.junit.stem}-{kind}{args.junit.suffix}") if args.junit
                 else Path(tmp) / "junit.xml")
        marks = f"({CPU_TIER_EXPRESSION}) and {RUNS[kind]}"
        cmd = [sys.executable, "-m", "pytest", *args.paths, "-n", str(args.workers), "-m", marks,
               f"--junitxml={junit}", "-o", "junit_family=xunit1", "-q", "-p", "no:cacheprovider", *args.pytest_args]
        print(f"[{kind}] running:", " ".join(cmd), flush=True)
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ), capture_output=True, text=True)
        wall = time.perf_counter() - start
        summary = [ln for ln in proc.stdout.splitlines() if ln.strip()][-1:] or ["(no pytest output)"]
        if not junit.is_file():
            print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n")
            return [f"{kind}: pytest wrote no JUnit report (exit code {proc.returncode})"]
        per_file = parse_junit(junit)

    print(format_table(per_file, wall, args.workers))
    print(f"[{kind}] pytest:", summary[0])
    problems = []
    if proc.returncode == 5 or not per_file:
        problems.append(f"{kind}: no tests collected")
    elif proc.returncode != 0:
        problems.append(f"{kind}: pytest exit code {proc.returncode} (failures above)")
        print(proc.stdout[-6000:])
    if wall > budget:
        problems.append(f"{kind}: wall time {wall:.1f} s exceeds the budget of {budget:.0f} s")
    print(f"[{kind}] " + ("FAIL: " + "; ".join(problems) if problems else f"OK: {wall:.1f} s within the budget of {budget:.0f} s"))
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=120.0, help="maximum wall seconds of the unit run (default 120)")
    parser.add_argument("--integration-budget", type=float, default=360.0,
                        help="maximum wall seconds of the integration run (default 360)")
    parser.add_argument("--only", choices=sorted(RUNS), help="time one of the two runs only")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (default 2)")
    parser.add_argument("--paths", nargs="+", default=["tests"], help="test paths (default: tests)")
    parser.add_argument("--junit", type=Path, help="keep the JUnit XML here (one file per run: <stem>-unit.xml...)")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    budgets = {"unit": args.budget, "integration": args.integration_budget}
    problems = [p for kind in RUNS if args.only in (None, kind) for p in run_once(kind, budgets[kind], args)]
    print("FAIL: " + "; ".join(problems) if problems else "OK: every run green and within its budget")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
