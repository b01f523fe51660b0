#!/usr/bin/env python
"""The nightly gate: run the conformance suite for one backend on one hardware tier (or every tier this
machine has), write the reports, and exit non-zero exactly when the gate fails.

    python ci/run_conformance.py --backend reference --tier cpu --out reports/reference
    python ci/run_conformance.py --backend flashinfer --tier all --out reports/flashinfer -- -k dense

Runs: the ``cpu`` run (pytest-xdist) holds every test except those of the GPU tiers this machine offers;
tests of tiers it lacks are collected there and skipped with the reason, so they are counted. ``--tier all``
adds one serial run per GPU tier the machine offers (GPU cases share one device); ``--tier cuda`` (etc.)
runs only that tier, and is a configuration error on a machine without it. Each run writes ``<out>/<tier>/{junit.xml,summary.json,report.md,artifacts/}``; the
gate merges them into ``<out>/{junit.xml,summary.json,report.md}``.

``--flashinfer-emulated`` rehearses the ``b200`` tier on any machine (FlashInfer's entry points routed to the
emulator, SM100 answered by the capability check): its tests run in the CPU run on a machine without a GPU, in
their own serial run on a GPU machine; the reports say EMULATED and never count them as B200 results.

Gate verdict: FAIL (exit 1) when a test fails or errors and no expectation covers it, when an expected
failure passes (XPASS strict), when an expectation entry matches no test (stale), when pytest stops
abnormally, or when no test was collected at all. Exit 2: the gate was misconfigured (unknown tier, tier
not present on this machine). Otherwise PASS (exit 0). See docs/reports.md.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # this checkout's suite, installed or not (a clean clone works as is)

from conformance.backends import BUILTIN_BACKENDS, backend_spec_from_env  # noqa: E402
# private: this script is the suite's own report runner (plans a run per tier from the tier table, merges the
# runs' summaries, gates them and renders report.md), the framework's code, not a test's
from conformance._framework.reporting import EMULATED_VERDICT_NOTE, gate_failures, merge_summaries, render_markdown  # noqa: E402
from conformance._framework.tiers import TIERS, tier_skip_reason  # noqa: E402
from conformance.testing import detect_hardware  # noqa: E402
from conformance.plugin import load_report_parts  # noqa: E402

GPU_TIERS = tuple(t for t in TIERS if t != "cpu")
EXPECTATIONS_DIR = REPO_ROOT / "ci" / "expectations"
EXIT_PASS, EXIT_FAIL, EXIT_CONFIG = 0, 1, 2


class GateConfigError(Exception):
    """The gate was asked for something this machine or this checkout cannot do."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default=None, help="built-in name or module:attr (default: $NVFP4_CONFORMANCE_BACKEND or reference)")
    p.add_argument("--tier", default="all", help=f"one of {', '.join(TIERS)}, or 'all' (every tier present; default)")
    p.add_argument("--out", default=None, help="report directory (default: reports/<backend>)")
    p.add_argument("--expectations", default=None,
                   help="expectations TOML (default: ci/expectations/<backend>.toml when it exists; 'none' for none)")
    p.add_argument("--tests", nargs="+", default=["conformance"], help="test paths, relative to --rootdir (default: conformance)")
    p.add_argument("--rootdir", default=str(REPO_ROOT), help="directory pytest runs in (default: the repository root)")
    p.add_argument("--workers", default="auto", help="pytest-xdist workers for the CPU run: auto, a number, or 0 (serial)")
    p.add_argument("--flashinfer-emulated", action="store_true",
                   help="rehearse the b200 tier on the FlashInfer emulator (reports say EMULATED; not a B200 result)")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments, after '--' (e.g. -- -k dense)")
    return p.parse_args(argv)


def default_expectations(spec: str) -> Path | None:
    if spec not in BUILTIN_BACKENDS:
        return None
    path = EXPECTATIONS_DIR / f"{spec}.toml"
    return path if path.exists() else None


def plan_runs(tier: str, emulated: bool = False) -> tuple[list[tuple[str, str | None, bool]], dict[str, str]]:
    """``[(run name, -m expression or None, parallel)]`` and the tiers not run, with reasons.

    The ``cpu`` run holds every test except those of the GPU tiers this machine has: tests of tiers it
    lacks are collected there and skipped with the reason, so the report counts them. Each GPU tier the
    machine has gets its own serial run (``--tier all``, or that tier named). ``emulated``: the ``b200`` tier
    is emulated on this host's device: in the (parallel) ``cpu`` run without a GPU, its own serial run with one."""
    hw = detect_hardware()
    present = [t for t in GPU_TIERS if tier_skip_reason(t, hw) is None]
    absent = {t: tier_skip_reason(t, hw) for t in GPU_TIERS if t not in present}
    if emulated:
        absent.pop("b200", None)
        if hw.gpus:
            present = [t for t in GPU_TIERS if t in present or t == "b200"]
    cpu_run = ("cpu", f"not ({' or '.join(present)})" if present else None, True)
    if tier == "all":
        return [cpu_run] + [(t, t, False) for t in present], absent
    if tier == "cpu":
        return [cpu_run], absent
    if tier not in TIERS:
        raise GateConfigError(f"unknown tier {tier!r}; use one of {', '.join(TIERS)} or 'all'")
    if tier in absent:
        raise GateConfigError(f"tier {tier!r} is not present on this machine: {absent[tier]}")
    if tier == "b200" and emulated and "b200" not in present:  # emulated on the CPU: parallel
        return [("b200", "b200", True)], {}
    return [(tier, tier, False)], {}


def pytest_command(args: argparse.Namespace, spec: str, expectations: Path | None, name: str,
                   marker_expr: str | None, parallel: bool, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", *args.tests, "--backend", spec, "--report-dir", str(out / name),
           "-o", "junit_family=xunit1", "-p", "no:cacheprovider"]  # xunit1: per-test <properties> (bound ratios)
    if marker_expr:
        cmd += ["-m", marker_expr]
    if args.flashinfer_emulated:
        cmd.append("--flashinfer-emulated")
    if expectations is not None:
        try:  # shorter repro commands: relative to where pytest runs
            expectations = expectations.relative_to(Path(args.rootdir).resolve())
        except ValueError:
            pass
        cmd += ["--expectations", expectations.as_posix()]
    if parallel and args.workers not in ("0", "") and importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", args.workers]
    return cmd + list(args.pytest_args)


def merge_junit(paths: list[tuple[str, Path]], dest: Path) -> None:
    """One ``<testsuites>`` holding every tier run's ``<testsuite>``, each named after its tier."""
    root = ET.Element("testsuites", name="nvfp4-conformance")
    for name, path in paths:
        if not path.exists():
            continue
        for suite in ET.parse(path).getroot().iter("testsuite"):
            suite.set("name", f"nvfp4-{name}")
            root.append(suite)
    ET.ElementTree(root).write(dest, encoding="utf-8", xml_declaration=True)


def run_gate(args: argparse.Namespace) -> int:
    spec = backend_spec_from_env(args.backend)
    if args.expectations == "none":
        expectations = None
    elif args.expectations:
        expectations = Path(args.expectations).resolve()
        if not expectations.exists():
            raise GateConfigError(f"expectations file {expectations} does not exist")
    else:
        expectations = default_expectations(spec)
    out = Path(args.out or REPO_ROOT / "reports" / re.sub(r"[^A-Za-z0-9_.-]+", "_", spec)).resolve()
    runs, absent = plan_runs(args.tier, args.flashinfer_emulated)
    out.mkdir(parents=True, exist_ok=True)

    summaries, junits, gate_runs, run_errors = [], [], [], []
    for name, marker_expr, parallel in runs:
        cmd = pytest_command(args, spec, expectations, name, marker_expr, parallel, out)
        print(f"[gate] tier run {name}: {shlex.join(cmd)}", flush=True)
        rc = subprocess.run(cmd, cwd=args.rootdir).returncode
        gate_runs.append({"run": name, "command": cmd, "exit_status": rc})
        summary_path = out / name / "summary.json"
        if summary_path.exists():
            summaries.append(json.loads(summary_path.read_text()))
            junits.append((name, out / name / "junit.xml"))
        else:
            run_errors.append(f"tier run {name!r} exited {rc} and wrote no summary")

    if not summaries:
        print("[gate] FAIL: no tier run produced a report", file=sys.stderr)
        return EXIT_FAIL
    merged = merge_summaries(summaries, absent)
    merged["run_errors"] += run_errors
    if not merged["tests"]:
        merged["run_errors"].append("no test was collected in any tier run")
    merged["gate"] = {"tier": args.tier, "runs": gate_runs, "report_dir": str(out)}
    failures = gate_failures(merged)
    merged["verdict"] = "pass" if not failures else "fail"
    (out / "summary.json").write_text(json.dumps(merged, indent=2, default=str) + "\n")
    load_report_parts()  # the areas' report sections (perf table, cross-case causes)
    (out / "report.md").write_text(render_markdown(merged))
    merge_junit(junits, out / "junit.xml")

    print(f"[gate] reports: {out}/junit.xml, {out}/summary.json, {out}/report.md")
    for t in merged["tests"]:
        if t["repro"] and t["outcome"] in ("failed", "error", "xpass_strict"):
            print(f"[gate] {t['outcome']}: {t['nodeid']}\n        repro: {t['repro']}")
    note = f" ({EMULATED_VERDICT_NOTE})" if merged.get("flashinfer_emulated") else ""
    print(f"[gate] {'PASS' if not failures else 'FAIL'}{note}" + "".join(f"\n  - {f}" for f in failures))
    return EXIT_PASS if not failures else EXIT_FAIL


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run_gate(args)
    except GateConfigError as exc:
        print(f"[gate] configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
