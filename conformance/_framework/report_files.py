"""``--report-dir DIR``: JUnit XML, a JSON summary and a Markdown conformance table from one run, plus
failure artifacts (safetensors) and a one-line repro command per failure. Works under pytest-xdist: the
per-test reports reach the controller through ``pytest_runtest_logreport`` (user properties travel with
them), and only the controller writes the reports. The backend calls a failing test's artifacts keep are
captured by :mod:`conformance._framework.backend_capture`. See docs/reports.md."""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from conformance import __version__
from conformance._framework import reporting
from conformance._framework.backend_capture import capture_backend_calls as _capture_backend_calls
from conformance._framework.selection_plugin import backends_of, selected
from conformance._framework.selection import backend_spec_from_env
from conformance._framework.reporting import Artifacts, TestRecord, area_of, gate_failures, render_markdown
from conformance._framework.tiers import TIERS, b200_emulated, detect_hardware, tier_skip_reason

_ARTIFACTS_KEY = pytest.StashKey[Artifacts]()
_STATE_KEY = pytest.StashKey["_RunState"]()
# Options of the "nvfp4" group that only shape the output or the selection, never what a case computes,
# so a repro command leaves them out.
_NOT_FOR_REPRO = {"report_dir", "artifacts_dir"}
# Default tier of a test with no tier marker: it needs nothing, like ``cpu``.
DEFAULT_TIER = "cpu"
NO_BACKEND = "-"

_parser: pytest.Parser | None = None  # kept to find every suite option a repro command must carry


def _suite_options() -> list:
    """Options of the suite's groups (``nvfp4``, ``nvfp4-server``, any ``nvfp4*``). pytest has no public
    list of groups, so this reads the parser's; without it, only the main group is known."""
    if _parser is None:
        return []
    groups = [g for g in getattr(_parser, "_groups", []) if g.name.startswith("nvfp4")]
    groups = groups or [_parser.getgroup("nvfp4")]
    return [opt for g in groups for opt in g.options]


def pytest_addoption(parser: pytest.Parser) -> None:
    global _parser
    _parser = parser
    group = parser.getgroup("nvfp4", "NVFP4 W4A16 conformance")
    group.addoption(
        "--report-dir",
        default=None,
        help="write junit.xml, summary.json, report.md and failure artifacts/ to this directory",
    )
    group.addoption(
        "--artifacts-dir",
        default=None,
        help="where failing tests' registered tensors go as safetensors (default: <report-dir>/artifacts)",
    )


def _artifacts_dir(config: pytest.Config) -> Path | None:
    explicit = config.getoption("--artifacts-dir")
    if explicit:
        return Path(explicit)
    report_dir = config.getoption("--report-dir")
    return Path(report_dir) / "artifacts" if report_dir else None


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


@pytest.hookimpl(tryfirst=True)  # before junitxml's pytest_configure reads --junitxml
def pytest_configure(config: pytest.Config) -> None:
    report_dir = config.getoption("--report-dir")
    if not report_dir:
        return
    if not config.option.xmlpath:
        config.option.xmlpath = str(Path(report_dir) / "junit.xml")
    if not _is_worker(config):
        config.stash[_STATE_KEY] = _RunState(config)


# ------------------------------------------------------------------------ worker / in-process side
def _tier_of(item: pytest.Item) -> str:
    tier = next((t for t in TIERS if item.get_closest_marker(t) is not None), DEFAULT_TIER)
    return reporting.EMULATED_B200_TIER if tier == "b200" and b200_emulated() else tier


def _backend_object(item: pytest.Item) -> Any:
    """The ``backend`` fixture's parametrized object of this test, or ``None``."""
    return getattr(getattr(item, "callspec", None), "params", {}).get("backend")


def _backend_of(item: pytest.Item) -> str:
    return getattr(_backend_object(item), "name", NO_BACKEND)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--report-dir"):
        return
    for item in items:  # travel to the controller with every report; also land in the JUnit XML
        item.user_properties.append(("tier", _tier_of(item)))
        item.user_properties.append(("backend", _backend_of(item)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    artifacts = item.stash[_ARTIFACTS_KEY] = Artifacts()
    reporting._set_current(artifacts)
    backend = _backend_object(item)
    restore = _capture_backend_calls(backend, artifacts) if _artifacts_dir(item.config) is not None else None
    try:
        return (yield)
    finally:
        if restore is not None:
            restore()
        reporting._set_current(None)
        del item.stash[_ARTIFACTS_KEY]


@pytest.fixture
def artifacts(request: pytest.FixtureRequest) -> Artifacts:
    """Register tensors with ``artifacts.save("io", x=x, y=y, ref=ref)``; they are written as
    ``<artifacts dir>/<test>/io.safetensors`` only if the test fails."""
    return request.node.stash[_ARTIFACTS_KEY]


def artifact_dir_name(nodeid: str) -> str:
    """A file-system-safe folder name for a test id."""
    return re.sub(r"[^A-Za-z0-9_.\-]+", "_", nodeid).strip("_")[:200]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    rep = yield
    artifacts = item.stash.get(_ARTIFACTS_KEY, None)
    directory = _artifacts_dir(item.config)
    if rep.failed and artifacts and directory is not None:
        metadata = {"nodeid": item.nodeid, "phase": rep.when, "backend": _backend_of(item)}
        paths = artifacts.write(directory / artifact_dir_name(item.nodeid), metadata)
        rep.user_properties.append(("artifacts", paths))
        item.stash[_ARTIFACTS_KEY] = Artifacts()  # written once; a teardown failure adds only new ones
    return rep


# ----------------------------------------------------------------------------- controller side
def _message(report: Any) -> str:
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple):  # skip: (path, lineno, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(longrepr)
    return " / ".join(line.strip() for line in text.strip().splitlines() if line.strip())[:500]


def _phase_outcome(report: pytest.TestReport) -> tuple[str, str]:
    wasxfail = getattr(report, "wasxfail", None)
    if report.passed:
        return ("xpassed", wasxfail) if wasxfail is not None else ("passed", "")
    if report.skipped:
        return ("xfailed", wasxfail or "") if wasxfail is not None else ("skipped", _message(report))
    text = str(report.longrepr) if report.longrepr is not None else ""
    if text.startswith("[XPASS(strict)]"):
        return "xpass_strict", "expected to fail but passed: " + text.removeprefix("[XPASS(strict)]").strip()
    return ("failed" if report.when == "call" else "error"), _message(report)


class _RunState:
    """What the controller gathers during the run, then writes at session end."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.records: dict[str, TestRecord] = {}
        self.written: dict[str, Any] | None = None  # the summary, once written at session end

    def record(self, nodeid: str, properties: dict[str, Any]) -> TestRecord:
        rec = self.records.get(nodeid)
        if rec is None:
            rec = self.records[nodeid] = TestRecord(
                nodeid=nodeid,
                area=str(properties.get("area") or area_of(nodeid)),
                backend=str(properties.get("backend", NO_BACKEND)),
                tier=str(properties.get("tier", DEFAULT_TIER)),
            )
        for key, value in properties.items():
            if key == "artifacts":
                rec.artifacts.extend(p for p in value if p not in rec.artifacts)
            elif key not in ("area", "backend", "tier"):
                rec.properties[key] = value
        return rec

    # -- repro
    def repro(self, nodeid: str) -> str:
        """The one command that reruns exactly this case with the run's backend and suite options,
        from the directory the run was started in."""
        config = self.config
        path, sep, rest = nodeid.partition("::")
        rel = os.path.relpath(config.rootpath / path, config.invocation_params.dir)
        args = ["python", "-m", "pytest", rel.replace(os.sep, "/") + sep + rest]
        invocation = list(config.invocation_params.args)
        for i, arg in enumerate(invocation[:-1]):  # plugins given with -p (e.g. when installed as a package)
            if arg == "-p":
                args += ["-p", invocation[i + 1]]
        given = set()
        for opt in _suite_options():
            value = config.getoption(opt.dest)
            if opt.dest in _NOT_FOR_REPRO or value == getattr(opt, "default", None) or value is None:
                continue
            name = max(opt.names(), key=len)
            given.add(opt.dest)
            if value is True:
                args.append(name)
            elif isinstance(value, list | tuple):
                for v in value:
                    args += [name, str(v)]
            elif value is not False:
                args += [name, str(value)]
        if "backend" not in given:  # taken from the environment or the default: make it explicit
            args += ["--backend", backend_spec_from_env(None)]
        return shlex.join(args)

    # -- summary
    def backends(self) -> list[dict[str, str]]:
        try:
            loaded = backends_of(self.config)
        except Exception as exc:  # noqa: BLE001 - the report must still be written, saying why
            return [{"name": "?", "version": f"could not load: {exc}"}]
        out = []
        for b in loaded:
            try:
                version = b.version()
            except Exception as exc:  # noqa: BLE001
                version = f"version() raised {type(exc).__name__}: {exc}"
            out.append({"name": b.name, "version": version})
        return out

    def summary(self, exitstatus: int) -> dict[str, Any]:
        hw = detect_hardware()
        tests = [r.as_dict() for _, r in sorted(self.records.items())]
        for t in tests:
            t["duration"] = round(t["duration"], 4)
        used = {t["tier"] for t in tests}
        tiers_run = [t for t in TIERS if t in used and tier_skip_reason(t, hw) is None]
        tiers_skipped = {t: tier_skip_reason(t, hw) for t in TIERS if t in used and tier_skip_reason(t, hw)}
        counts: dict[str, int] = {}
        for t in tests:
            counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
        summary = {
            "suite_version": __version__,
            "generated_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "backend_spec": selected(self.config).backend,
            "backends": self.backends(),
            "hardware": hw.describe(),
            "tiers": {"run": tiers_run, "skipped": tiers_skipped,
                      **({"emulated": ["b200"]} if reporting.EMULATED_B200_TIER in used else {})},
            "flashinfer_emulated": b200_emulated(),
            "expectations": self.config.getoption("--expectations", None),
            "command": ["python", "-m", "pytest", *self.config.invocation_params.args],
            "repro_cwd": str(self.config.invocation_params.dir),
            "exit_status": int(exitstatus),
            "counts": counts,
            "rules": reporting.rules_under_test(tests),
            "run_errors": [],
            reporting.NOT_SHOWN_KEY: reporting.known_failures_not_shown(tests),
            "tests": tests,
        }
        if int(exitstatus) not in (0, 1, 5):
            summary["run_errors"].append(f"pytest exit status {int(exitstatus)} (interrupted, internal or usage error)")
        elif int(exitstatus) == 1 and not any(r.failing for r in self.records.values()):
            summary["run_errors"].append("pytest exit status 1 without a failing test record")
        summary["verdict"] = "pass" if not gate_failures(summary) else "fail"
        return summary


def _state(config: pytest.Config) -> _RunState | None:
    return config.stash.get(_STATE_KEY, None)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    state = _controller_state()
    if state is None:
        return
    rec = state.record(report.nodeid, dict(report.user_properties))
    outcome, message = _phase_outcome(report)
    rec.update(outcome, message)
    rec.duration += getattr(report, "duration", 0.0) or 0.0
    if rec.failing and rec.repro is None and rec.area != reporting.EXPECTATIONS_AREA:
        rec.repro = state.repro(report.nodeid)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    state = _controller_state()
    if state is None or not report.failed:
        return
    rec = state.record(report.nodeid or ".", {})
    lines = [ln.strip() for ln in str(report.longrepr).splitlines() if ln.strip()]
    errors = [ln.removeprefix("E").strip() for ln in lines if ln.startswith("E ")]
    rec.update("error", "collection error: " + (" / ".join(errors) or (lines[-1] if lines else ""))[:500])
    rec.repro = state.repro(report.nodeid) if report.nodeid else None


_active_state: list[_RunState] = []  # logreport hooks get no config; the controller's state lives here


def _controller_state() -> _RunState | None:
    return _active_state[-1] if _active_state else None


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    state = _state(session.config)
    if state is not None:
        _active_state.append(state)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    state = _state(session.config)
    if state is None:
        return
    if state in _active_state:
        _active_state.remove(state)
    out = Path(session.config.getoption("--report-dir"))
    out.mkdir(parents=True, exist_ok=True)
    summary = state.summary(exitstatus)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    (out / "report.md").write_text(render_markdown(summary))
    state.written = summary


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    state = _state(config)
    summary = state.written if state is not None else None
    if summary is None:
        return
    out = config.getoption("--report-dir")
    tr = terminalreporter
    tr.section("nvfp4 conformance report")
    note = f" ({reporting.EMULATED_VERDICT_NOTE})" if summary.get("flashinfer_emulated") else ""
    tr.line(f"verdict: {summary['verdict'].upper()}{note}; reports in {out}: junit.xml, summary.json, report.md")
    for t in summary["tests"]:
        if t["outcome"] in reporting.FAILING_OUTCOMES and t["repro"]:
            tr.line(f"{t['outcome']}: {t['nodeid']}\n    repro: {t['repro']}")
    for t in summary.get(reporting.NOT_SHOWN_KEY, []):
        tr.line(f"known failure did not show (non-strict XPASS, not a failure): {t['nodeid']}")
