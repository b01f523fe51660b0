"""Cross-case diagnosis of a report's test records: which dense / MoE case each test ran (from its node id), the
tests that failed on it, and the area's patterns (:data:`conformance.dense.diagnosis.PATTERNS`,
:data:`conformance.moe.diagnosis.PATTERNS`) over them. Kept apart from :mod:`conformance._framework.reporting`
so that rendering a report imports the areas' case tables only when there are dense or MoE tests."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from conformance._framework.diagnosis import Diagnosis

#: area (as :func:`conformance._framework.reporting.area_of` names it) -> the test file whose tests are judged
_AREA_FILES = {"dense": "conformance/dense/test_dense.py", "MoE": "conformance/moe/test_moe.py"}


def _areas():
    from conformance.dense import diagnosis as dense
    from conformance.dense.cases import DENSE_CASES
    from conformance.moe import diagnosis as moe
    from conformance.moe.cases import MOE_CASES

    return {"dense": ({c.id: c for c in DENSE_CASES}, dense.diagnose_dense_cases),
            "MoE": ({c.id: c for c in MOE_CASES}, moe.diagnose_moe_cases)}


def _split(nodeid: str) -> tuple[str, str, str] | None:
    """``file::test[backend-case]`` -> (file, test, ``backend-case``)."""
    path, _, rest = nodeid.partition("::")
    test, _, param = rest.partition("[")
    return (path, test, param.rstrip("]")) if param else None


def patterns_across_cases(tests: Iterable[Mapping[str, Any]]) -> list[tuple[str, str, Diagnosis]]:
    """``(area, backend, diagnosis)`` for every pattern found among the failed and passed tests (skipped and
    expected failures do not count either way)."""
    tests = [t for t in tests if t.get("area") in _AREA_FILES and t.get("outcome") in ("passed", "failed", "error")]
    if not tests:
        return []
    areas = _areas()
    grouped: dict[tuple[str, str], dict[str, tuple[Any, set[str]]]] = {}
    for t in tests:
        parts = _split(t["nodeid"])
        if parts is None or not parts[0].endswith(_AREA_FILES[t["area"]]):
            continue
        cases, _ = areas[t["area"]]
        prefix = f"{t['backend']}-"
        case = cases.get(parts[2][len(prefix):]) if parts[2].startswith(prefix) else None
        if case is None:
            continue
        entry = grouped.setdefault((t["area"], t["backend"]), {}).setdefault(case.id, (case, set()))
        if t["outcome"] != "passed":
            entry[1].add(parts[1])
    found = []
    for (area, backend), by_case in sorted(grouped.items()):
        for d in areas[area][1](by_case.values()):
            found.append((area, backend, d))
    return found
