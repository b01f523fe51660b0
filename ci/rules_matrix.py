"""Run the configuration/guard rule matrices and the upstream-expectations oracle against one engine; print
cases per matrix, oracle verdicts per area (agree / disagree / n/a) and run time.

    python ci/rules_matrix.py                    # reference engine, rules profile sglang-0.5.23
    python ci/rules_matrix.py --engine sglang    # SGLang 0.5.23's own code on CPU
    python ci/rules_matrix.py --rules-profile sglang-main   # the reference rules as SGLang main
    python ci/rules_matrix.py --engine sglang --budget 60   # exit 1 if the whole run exceeds 60 s

Exit status 1 if any case fails or any upstream expectation disagrees (printed with both sides), or the
budget is exceeded. Unsupported cases are counted and listed with the engine's reason.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conformance.rules import ENGINE_DEFAULT_PROFILES, EngineUnavailable, engine_spec, load_rules_engine  # noqa: E402
from conformance.rules.matrix import (DEFAULT_PROFILE, MATRICES, load_matrix, load_profile,  # noqa: E402
                                        mismatch, run_case)
from conformance.rules.oracle import AGREE, DISAGREE, NOT_APPLICABLE, tally  # noqa: E402


def _parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, str]:
    """The options and the rules profile (checked: a bad one exits with the parser's usage error)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default=None, help="reference | sglang | module:attr (default $NVFP4_CONFORMANCE_ENGINE or reference)")
    parser.add_argument("--rules-profile", default=None,
                        help=f"rules profile (default {DEFAULT_PROFILE}; vllm-0.32 for --engine vllm)")
    parser.add_argument("--budget", type=float, default=None, help="fail if the total wall time exceeds this many seconds")
    args = parser.parse_args(argv)
    profile = args.rules_profile or ENGINE_DEFAULT_PROFILES.get(engine_spec(args.engine), DEFAULT_PROFILE)
    try:
        load_profile(profile)
    except ValueError as exc:
        parser.error(str(exc))
    return args, profile


def _run_matrix(engine, name: str, profile: str, failures: list[str], reasons: Counter) -> Counter:
    """Run one matrix, print its row; the failures and unsupported reasons are added to the lists given."""
    t0 = time.perf_counter()
    cases = load_matrix(name)
    counts = Counter()
    for case in cases:
        reason = case.not_modelled(profile) or engine.unsupported(name, case.inputs)
        if reason:
            counts["unsupported"] += 1
            reasons[reason] += 1
            continue
        problem = mismatch(case, run_case(engine, case), profile)
        counts["failed" if problem else "passed"] += 1
        if problem:
            failures.append(problem)
    kinds = Counter(c.expected_for(profile)["kind"] for c in cases if not c.not_modelled(profile))
    print(f"{name:<15} {len(cases):>6} {counts['passed']:>7} {counts['failed']:>7} {counts['unsupported']:>8} "
          f"{time.perf_counter() - t0:>8.2f}  " + ", ".join(f"{k}={v}" for k, v in sorted(kinds.items())))
    counts["cases"] += len(cases)
    return counts


def _run_matrices(engine, profile: str) -> tuple[list[str], Counter]:
    """Every matrix, a row each and the total row: the failures and the unsupported reasons (with counts)."""
    start = time.perf_counter()
    print(f"{'matrix':<15} {'cases':>6} {'passed':>7} {'failed':>7} {'unsupp.':>8} {'seconds':>8}  expected kinds")
    failures, reasons, totals = [], Counter(), Counter()
    for name in MATRICES:
        totals.update(_run_matrix(engine, name, profile, failures, reasons))
    print(f"{'total':<15} {totals['cases']:>6} {totals['passed']:>7} {totals['failed']:>7} {totals['unsupported']:>8} "
          f"{time.perf_counter() - start:>8.2f}")
    return failures, reasons


def _run_oracle(engine, profile: str) -> list[str]:
    """The upstream-expectations verdicts per area, printed; returns the disagreements."""
    t0 = time.perf_counter()
    counts = tally(engine, profile)
    disagreements = counts.pop("_failures")
    print(f"\nupstream expectations (fixtures/config_rules/upstream_expectations.json), rules profile {profile}")
    print(f"{'area':<15} {'agree':>6} {'disagree':>9} {'n/a':>5}")
    for area, c in sorted(counts.items()):
        print(f"{area:<15} {c[AGREE]:>6} {c[DISAGREE]:>9} {c[NOT_APPLICABLE]:>5}")
    print(f"{'total':<15} {sum(c[AGREE] for c in counts.values()):>6} "
          f"{sum(c[DISAGREE] for c in counts.values()):>9} {sum(c[NOT_APPLICABLE] for c in counts.values()):>5}"
          f"  ({time.perf_counter() - t0:.2f} s)")
    return disagreements


def _print_problems(reasons: Counter, failures: list[str]) -> None:
    for reason, n in reasons.items():
        print(f"unsupported x{n}: {reason}")
    for problem in failures[:20]:
        print("FAIL " + problem)
    if len(failures) > 20:
        print(f"... and {len(failures) - 20} more failures")


def main(argv: list[str] | None = None) -> int:
    args, profile = _parse_args(argv)
    spec = engine_spec(args.engine)
    start = time.perf_counter()
    try:
        engine = load_rules_engine(spec)
    except EngineUnavailable as exc:
        print(f"engine {spec!r} unavailable: {exc}")
        return 2
    engine.use_profile(profile)
    load_s = time.perf_counter() - start
    print(f"engine: {engine.name} ({engine.version()}); rules profile: {profile}; load {load_s:.1f} s")
    failures, reasons = _run_matrices(engine, profile)
    failures += _run_oracle(engine, profile)
    total_s = time.perf_counter() - start
    print(f"\nwall time {total_s:.1f} s (engine load {load_s:.1f} s)")
    _print_problems(reasons, failures)
    if args.budget is not None and total_s > args.budget:
        print(f"over budget: {total_s:.1f} s > {args.budget:.0f} s")
        return 1
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
