"""Cross-case diagnosis of a report's test records: which dense / MoE case each test ran (from its node id), the
tests that failed on it, and the area's patterns over them. Each area registers its case table and its
diagnosis with :func:`register_case_diagnoser` (from its pytest plugin, e.g. ``conformance/dense/plugin.py``), so
the framework renders the section without importing any area."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from conformance._framework.diagnosis import Diagnosis


@dataclass(frozen=True)
class CaseDiagnoser:
    """One area's cross-case diagnosis: ``area`` as :func:`conformance._framework.reporting.area_of` names it,
    ``test_file`` the file whose tests are judged, ``cases`` case id -> case, ``diagnose`` the area's patterns
    over ``(case, failed test names)`` pairs."""

    area: str
    test_file: str
    cases: Mapping[str, Any]
    diagnose: Callable[[Iterable[tuple[Any, set[str]]]], list[Diagnosis]]


_DIAGNOSERS: dict[str, CaseDiagnoser] = {}


def register_case_diagnoser(diagnoser: CaseDiagnoser) -> None:
    """Add (or replace) an area's cross-case diagnosis."""
    _DIAGNOSERS[diagnoser.area] = diagnoser


def _split(nodeid: str) -> tuple[str, str, str] | None:
    """``file::test[backend-case]`` -> (file, test, ``backend-case``)."""
    path, _, rest = nodeid.partition("::")
    test, _, param = rest.partition("[")
    return (path, test, param.rstrip("]")) if param else None


def patterns_across_cases(tests: Iterable[Mapping[str, Any]]) -> list[tuple[str, str, Diagnosis]]:
    """``(area, backend, diagnosis)`` for every pattern found among the failed and passed tests (skipped and
    expected failures do not count either way)."""
    tests = [t for t in tests if t.get("area") in _DIAGNOSERS and t.get("outcome") in ("passed", "failed", "error")]
    grouped: dict[tuple[str, str], dict[str, tuple[Any, set[str]]]] = {}
    for t in tests:
        area = _DIAGNOSERS[t["area"]]
        parts = _split(t["nodeid"])
        if parts is None or not parts[0].endswith(area.test_file):
            continue
        prefix = f"{t['backend']}-"
        case = area.cases.get(parts[2][len(prefix):]) if parts[2].startswith(prefix) else None
        if case is None:
            continue
        entry = grouped.setdefault((t["area"], t["backend"]), {}).setdefault(case.id, (case, set()))
        if t["outcome"] != "passed":
            entry[1].add(parts[1])
    found = []
    for (area, backend), by_case in sorted(grouped.items()):
        for d in _DIAGNOSERS[area].diagnose(by_case.values()):
            found.append((area, backend, d))
    return found
