"""Conformance reports: what one run found, per test, per capability area and per backend.

Public pieces:

- :func:`record_tensors` / :class:`Artifacts` (the ``artifacts`` fixture): register a check's inputs and
  outputs; the report plugin writes them as safetensors only when the test fails, so every failure can be
  inspected offline.
- :func:`area_of`: the capability area a test belongs to, from its file name.
- :class:`TestRecord` and :func:`render_markdown` / :func:`merge_summaries`: the JSON summary's per-test
  entries and the Markdown conformance table built from a summary (one run or several tier runs merged).
- :func:`known_failures_not_shown`: the tests whose non-strict known failure did not show in the run (XPASS),
  the summary's :data:`conformance._framework.report_text.NOT_SHOWN_KEY` list and report.md's section of the same name.

The pytest side (hooks, options, xdist) is in :mod:`conformance._framework.report_files`.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from conformance._framework.report_text import (NOT_SHOWN_HINT, NOT_SHOWN_KEY, NOT_SHOWN_TITLE,  # noqa: F401 (re-exported)
                                                fmt_ids, fmt_ratio, known_failures_not_shown, markdown_cell,
                                                not_shown_section)
from conformance._framework.tiers import TIERS

# ------------------------------------------------------------------------------------- areas
#: Capability areas, in the order the table lists them.
AREAS_IN_ORDER = ("format", "dense", "MoE", "config rules", "LM head", "reload", "server", "engine integration",
                  "perf")
#: Area package (``conformance/<folder>/``) -> its capability area: a new test module lands in its folder's area.
FOLDER_AREAS = {"format": "format", "dense": "dense", "moe": "MoE", "rules": "config rules", "server": "server",
                "engine_harness": "engine integration", "backends": "engine integration", "perf": "perf"}
#: Test modules of a folder that report a narrower area than the folder's.
MODULE_AREAS = {"conformance/rules/test_lm_head_guard.py": "LM head",
                "conformance/rules/test_reload_binding.py": "reload"}
#: Test-file stem (without ``test_``) prefix -> area, for test files outside an area folder (0.1's flat layout).
AREAS: tuple[tuple[str, str], ...] = (
    ("format", "format"),
    ("dense", "dense"),
    ("moe", "MoE"),
    ("config_rules", "config rules"),
    ("lm_head", "LM head"),
    ("reload", "reload"),
    ("server", "server"),
    ("engine", "engine integration"),
    ("emulator", "engine integration"),
    ("perf", "perf"),
)
OTHER_AREA = "other"
EXPECTATIONS_AREA = "expectations"
AREA_ORDER = [*AREAS_IN_ORDER, EXPECTATIONS_AREA, OTHER_AREA]


def area_of(nodeid: str) -> str:
    """``conformance/moe/test_moe.py::test_x[...]`` -> ``"MoE"``: the area of the test's package folder
    (:data:`FOLDER_AREAS`, narrowed by :data:`MODULE_AREAS`); a test file outside an area folder is matched by
    its stem (minus ``test_``) against :data:`AREAS` by prefix; anything else -> ``other``."""
    path = nodeid.split("::", 1)[0].replace("\\", "/")
    if path in MODULE_AREAS:
        return MODULE_AREAS[path]
    parts = Path(path).parts
    if len(parts) >= 3 and parts[-3] == "conformance" and parts[-2] in FOLDER_AREAS:
        return FOLDER_AREAS[parts[-2]]
    stem = Path(path).stem
    stem = stem[len("test_"):] if stem.startswith("test_") else stem
    for prefix, area in AREAS:
        if stem.startswith(prefix):
            return area
    return OTHER_AREA


# --------------------------------------------------------------------------------- artifacts
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class Artifacts:
    """Tensors a test registered for its failure report. ``save`` only remembers them; the report plugin
    writes ``<artifacts dir>/<test>/<name>.safetensors`` if (and only if) the test fails. Tensors are
    written as they are when the test ends (copied to CPU, made contiguous)."""

    def __init__(self) -> None:
        self._groups: dict[str, dict[str, torch.Tensor]] = {}

    def save(self, name: str, **tensors: torch.Tensor) -> None:
        """Register ``tensors`` under the file name ``name`` (letters, digits, ``_.-``); a later call with
        the same name adds to / replaces tensors of that group."""
        if not _SAFE_NAME.match(name):
            raise ValueError(f"artifact name {name!r} must match {_SAFE_NAME.pattern} (it becomes a file name)")
        if not tensors:
            raise ValueError("artifacts.save needs at least one tensor, e.g. save('io', x=x, y=y)")
        for key, value in tensors.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"artifact {name}.{key} is {type(value).__name__}, not a torch.Tensor")
        self._groups.setdefault(name, {}).update(tensors)

    def __bool__(self) -> bool:
        return bool(self._groups)

    def write(self, directory: Path, metadata: Mapping[str, str]) -> list[str]:
        """Write every registered group to ``directory`` as safetensors; returns the file paths."""
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        paths = []
        for name, tensors in self._groups.items():
            # clone: safetensors refuses views sharing one storage, and wants contiguous CPU tensors
            cpu = {k: t.detach().to("cpu").contiguous().clone() for k, t in tensors.items()}
            path = directory / f"{name}.safetensors"
            save_file(cpu, str(path), metadata=dict(metadata))
            paths.append(str(path))
        return paths


_current: Artifacts | None = None  # the running test's artifacts; set by the report plugin


def record_tensors(name: str, **tensors: torch.Tensor) -> bool:
    """Register tensors of the currently running test for its failure artifacts (see :class:`Artifacts`).
    Usable from check helpers that have no fixture at hand. Returns ``False`` (and does nothing) when no
    test is running under the suite's plugin, e.g. when a check is called from a plain script."""
    if _current is None:
        return False
    _current.save(name, **tensors)
    return True


def _set_current(artifacts: Artifacts | None) -> None:
    global _current
    _current = artifacts


# ------------------------------------------------------------------------------ test records
#: The tier recorded for a ``b200`` test run under ``--flashinfer-emulated``: never counted as ``b200``.
EMULATED_B200_TIER = "b200-emulated"
EMULATED_VERDICT_NOTE = (
    "EMULATED b200 tier (--flashinfer-emulated): FlashInfer's W4A16 entry points ran on "
    "reference_impl.flashinfer_emulator; not a B200 result"
)
FAILING_OUTCOMES = ("failed", "error", "xpass_strict")
#: outcome -> table column
COLUMN_OF = {
    "passed": "pass", "xpassed": "pass",
    "failed": "fail", "error": "fail", "xpass_strict": "fail",
    "xfailed": "xfail",
    "skipped": "skip",
}
# A later phase may only make an outcome worse, never better (a teardown error after a pass is an error); an
# XPASS (a non-strict expected failure that passed) is kept over its teardown's pass.
_SEVERITY = {"passed": 0, "xpassed": 1, "skipped": 2, "xfailed": 2, "failed": 3, "xpass_strict": 3, "error": 4}


@dataclass
class TestRecord:
    """One test's result in the JSON summary."""

    __test__ = False  # not a pytest test class, despite the name

    nodeid: str
    area: str
    backend: str
    tier: str
    outcome: str = "passed"
    message: str = ""
    duration: float = 0.0
    properties: dict[str, Any] = field(default_factory=dict)
    repro: str | None = None
    artifacts: list[str] = field(default_factory=list)

    def update(self, outcome: str, message: str) -> None:
        if _SEVERITY[outcome] >= _SEVERITY[self.outcome]:
            self.outcome, self.message = outcome, message or self.message

    @property
    def failing(self) -> bool:
        return self.outcome in FAILING_OUTCOMES

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def bound_ratio_of(test: Mapping[str, Any]) -> float | None:
    value = test.get("properties", {}).get("bound_ratio")
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def _worst(values: Iterable[float]) -> float | None:
    worst = None
    for v in values:
        if math.isnan(v):
            return v  # NaN error is the worst there is
        worst = v if worst is None else max(worst, v)
    return worst


# ----------------------------------------------------------------------------- summaries
def table_rows(tests: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Area x backend rows: counts per column, worst bound ratio, failing ids (areas in :data:`AREA_ORDER`)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for t in tests:
        backend = t["backend"] + (" (emulated)" if t.get("tier") == EMULATED_B200_TIER else "")
        row = rows.setdefault((t["area"], backend), {
            "area": t["area"], "backend": backend, "pass": 0, "fail": 0, "xfail": 0, "skip": 0,
            "ratios": [], "failing": [],
        })
        row[COLUMN_OF[t["outcome"]]] += 1
        ratio = bound_ratio_of(t)
        if ratio is not None:
            row["ratios"].append(ratio)
        if t["outcome"] in FAILING_OUTCOMES:
            row["failing"].append(t["nodeid"])
    order = {a: i for i, a in enumerate(AREA_ORDER)}
    out = []
    for key in sorted(rows, key=lambda k: (order.get(k[0], len(order)), k[1])):
        row = rows[key]
        row["worst_bound_ratio"] = _worst(row.pop("ratios"))
        out.append(row)
    return out


def gate_failures(summary: Mapping[str, Any]) -> list[str]:
    """Why the gate fails (empty: it passes): failing tests, and run-level problems the runs recorded."""
    reasons = [f"{t['outcome']}: {t['nodeid']}" for t in summary["tests"] if t["outcome"] in FAILING_OUTCOMES]
    return reasons + list(summary.get("run_errors", []))


def merge_summaries(summaries: list[Mapping[str, Any]], skipped_tiers: Mapping[str, str]) -> dict[str, Any]:
    """One summary for several tier runs of the same backend (the gate's ``--tier all``).
    ``skipped_tiers``: tiers the gate did not run, with the reason."""
    if not summaries:
        raise ValueError("nothing to merge: no tier was run")
    merged = {k: v for k, v in summaries[0].items() if k not in ("tests", "tiers", "run_errors", "verdict")}
    merged["tests"] = [t for s in summaries for t in s["tests"]]
    merged["run_errors"] = [e for s in summaries for e in s.get("run_errors", [])]
    merged["tiers"] = {
        "run": sorted({t for s in summaries for t in s["tiers"]["run"]}),
        "skipped": {**{t: r for s in summaries for t, r in s["tiers"]["skipped"].items()}, **skipped_tiers},
    }
    emulated = sorted({t for s in summaries for t in s["tiers"].get("emulated", [])})
    if emulated:
        merged["tiers"]["emulated"] = emulated
        for tier in emulated:
            merged["tiers"]["skipped"].pop(tier, None)
    if any(s.get("flashinfer_emulated") for s in summaries):
        merged["flashinfer_emulated"] = True
    merged[NOT_SHOWN_KEY] = known_failures_not_shown(merged["tests"])
    merged["verdict"] = "pass" if not gate_failures(merged) else "fail"
    return merged


# ------------------------------------------------------------------------------- markdown
_MAX_MESSAGE = 300


def rules_under_test(tests: Iterable[Mapping[str, Any]]) -> dict[str, list[str]]:
    """The rules engines (name and version) and rules profiles the run's rule cases recorded."""
    found: dict[str, set[str]] = {"engines": set(), "profiles": set()}
    for t in tests:
        props = t.get("properties", {})
        for key, bucket in (("rules_engine", "engines"), ("rules_profile", "profiles")):
            if props.get(key):
                found[bucket].add(str(props[key]))
    return {k: sorted(v) for k, v in found.items()}


#: Markdown sections an area adds to every report (its pytest plugin registers them): ``section(tests) -> lines``
_SECTIONS: list[Callable[[list[Mapping[str, Any]]], list[str]]] = []


def register_section(section: Callable[[list[Mapping[str, Any]]], list[str]]) -> None:
    """Add an area's report section (after the failures and the cross-case patterns; once per function)."""
    if section not in _SECTIONS:
        _SECTIONS.append(section)


def render_markdown(summary: Mapping[str, Any]) -> str:
    """The human-readable report: verdict, run facts, the area x backend table, then each failure with
    its repro command and artifacts, expected failures with reasons, and skips grouped by reason."""
    tests = summary["tests"]
    failures = gate_failures(summary)
    backends = ", ".join(f"{b['name']} ({b['version']})" for b in summary["backends"]) or "-"
    tiers = summary["tiers"]
    order = {t: i for i, t in enumerate(TIERS)}
    skipped_tiers = "; ".join(
        f"{t} ({r})" for t, r in sorted(tiers["skipped"].items(), key=lambda kv: order.get(kv[0], len(order)))
    ) or "none"
    run = [*tiers["run"], *(f"{t} (EMULATED, not a {t} result)" for t in tiers.get("emulated", []))]
    not_shown = known_failures_not_shown(tests)
    lines = [
        "# NVFP4 W4A16 conformance report",
        "",
        f"**Verdict: {'PASS' if not failures else 'FAIL'}**"
        + ("" if not failures else f" ({len(failures)} gate failure{'s' * (len(failures) != 1)})")
        + (f"; {EMULATED_VERDICT_NOTE}" if summary.get("flashinfer_emulated") else ""),
        "",
        f"- Suite version: {summary['suite_version']}",
        f"- Backend: `{summary['backend_spec']}`: {backends}",
        f"- Hardware: {summary['hardware']}",
        f"- Tiers run: {', '.join(run) or 'none'}",
        f"- Tiers skipped: {skipped_tiers}",
        f"- Expectations: {summary.get('expectations') or 'none'}",
        *([f"- Rules engine: {', '.join(summary['rules']['engines'])}; rules profile: "
           f"{', '.join(summary['rules']['profiles'])}"] if (summary.get("rules") or {}).get("engines") else []),
        f"- Tests: {len(tests)}",
        *([f"- Known failures that did not show: {len(not_shown)} (non-strict XPASS, not a failure; see below)"]
          if not_shown else []),
        "",
        "## Conformance table",
        "",
        "Worst bound ratio: the largest measured error / derived error bound among the area's checks (<= 1 passes).",
        "",
        "| Area | Backend | Pass | Fail | Expected fail | Skipped | Worst bound ratio | Failing cases |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in table_rows(tests):
        lines.append(
            f"| {r['area']} | {r['backend']} | {r['pass']} | {r['fail']} | {r['xfail']} | {r['skip']} "
            f"| {fmt_ratio(r['worst_bound_ratio'])} | {markdown_cell(fmt_ids(r['failing']))} |"
        )
    lines += _failures_section(summary)
    lines += not_shown_section(not_shown)
    lines += _patterns_section(tests)
    for section in _SECTIONS:
        lines += section(tests)
    lines += _expected_and_skipped_sections(tests)
    return "\n".join(lines).rstrip() + "\n"


def _expected_and_skipped_sections(tests: list[Mapping[str, Any]]) -> list[str]:
    """The expected failures with their reasons, then the skips counted by reason."""
    lines: list[str] = []
    xfailed = [t for t in tests if t["outcome"] == "xfailed"]
    if xfailed:
        lines += ["", "## Expected failures", "", "| Case | Reason |", "| --- | --- |"]
        lines += [f"| `{t['nodeid']}` | {markdown_cell(t['message'])} |" for t in xfailed]
    skipped: dict[str, int] = {}
    for t in tests:
        if t["outcome"] == "skipped":
            skipped[t["message"]] = skipped.get(t["message"], 0) + 1
    if skipped:
        lines += ["", "## Skipped, by reason", "", "| Reason | Tests |", "| --- | ---: |"]
        lines += [f"| {markdown_cell(reason)} | {n} |" for reason, n in sorted(skipped.items(), key=lambda kv: -kv[1])]
    return lines


def _failures_section(summary: Mapping[str, Any]) -> list[str]:
    """Run errors, then each failing test: message, bound ratio, likely cause, artifacts and repro command."""
    failing = [t for t in summary["tests"] if t["outcome"] in FAILING_OUTCOMES]
    if not failing and not summary.get("run_errors"):
        return []
    lines = ["", "## Failures", ""]
    if summary.get("repro_cwd"):
        lines += [f"Repro commands run from `{summary['repro_cwd']}`.", ""]
    for e in summary.get("run_errors", []):
        lines.append(f"- run error: {e}")
    for t in failing:
        lines += [f"### `{t['nodeid']}`", "", f"- outcome: **{t['outcome']}** ({t['area']}, tier {t['tier']})"]
        if t["message"]:
            lines.append(f"- message: {markdown_cell(t['message'][:_MAX_MESSAGE])}")
        ratio = bound_ratio_of(t)
        if ratio is not None:
            lines.append(f"- bound ratio: {fmt_ratio(ratio)}")
        if t.get("properties", {}).get("diagnosis"):
            lines.append(f"- likely cause: {markdown_cell(str(t['properties']['diagnosis']))}")
        for path in t["artifacts"]:
            lines.append(f"- artifact: `{path}`")
        if t["repro"]:
            lines += ["", "```bash", t["repro"], "```"]
        lines.append("")
    return lines


def _patterns_section(tests: Iterable[Mapping[str, Any]]) -> list[str]:
    """Failures that follow a pattern across cases (:func:`conformance._framework.diagnosis.diagnose_cases`)."""
    from conformance._framework.diagnosis_cases import patterns_across_cases

    found = patterns_across_cases(tests)
    if not found:
        return []
    lines = ["", "## Likely causes across cases", "",
             "A check failing only on cases that share a feature, or only beyond a size, points at the code that "
             "handles them (docs/reports.md, 'Likely causes'); the failures above are the verdict.", ""]
    lines += [f"- {area}, {backend}: [{d.rule}] {markdown_cell(d.text)}" for area, backend, d in found]
    return lines
