"""``--expectations FILE``: a backend's known failures and unsupported cases, by test-id prefix.

The file is TOML (see ci/expectations/ and docs/reports.md)::

    [[xfail]]                      # known failure: the test runs and must fail (strict unless strict = false)
    id = "conformance/dense/test_dense.py::test_dense[flashinfer-cudnn-"
    reason = "cuDNN path rounds alpha to bf16"
    link = "https://github.com/org/repo/issues/1"   # optional
    match = "alpha .* bf16"         # optional: a regex the failure's message must contain (re.search)
    evidence = "report.md of run N: ..."   # optional: what showed the failure (the command, the log line)
    strict = false                 # optional, default true; false: a pass is XPASS, not a failure
    why_not_strict = "..."         # required with strict = false: why the failure does not show on every run

    [[unsupported]]                # declared unsupported: the test is skipped with the reason
    id = "conformance/moe/test_moe.py::"
    reason = "no fused MoE in this engine"

Matching tests get ``xfail(strict=True)`` (an expected failure that passes fails the run: XPASS(strict))
or ``skip``. An ``xfail`` entry with ``match`` is stricter still: the test must fail *as recorded*; a
failure whose message does not contain the pattern fails the run ("failed for another reason"), so a new
bug cannot hide behind a known one. ``strict = false`` (``[[xfail]]`` only, with a non-empty
``why_not_strict``) gives ``xfail(strict=False)`` instead, for a failure that does not show on every run
(it depends on the engine's scheduling, say): a pass is reported as XPASS and does not fail the run, a
failure is still an expected failure (and with ``match`` must still fail as recorded); the reason says
"non-strict" and why. Every test an ``[[xfail]]`` entry covers carries the entry in its user properties
(:data:`ENTRY_PROPERTY`, :data:`REASON_PROPERTY`, and :data:`WHY_NOT_STRICT_PROPERTY` for a non-strict one),
so the reports can list the non-strict known failures that did not show (docs/reports.md) and ci/stress.py can
tell them apart in a JUnit report. An entry that matches no collected test, although the run collected where
it points, fails the run through a synthetic test ``<file>::stale[<id>]``, so the list cannot rot. Ids are
relative to the rootdir (the repository root), as pytest prints them.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

KINDS = ("xfail", "unsupported")
_ALLOWED_KEYS = {"id", "reason", "link", "match", "evidence", "strict", "why_not_strict"}
_KEY = pytest.StashKey["ExpectationSet"]()
#: User properties of a test an [[xfail]] entry covers (in the JSON summary's ``properties`` and, with
#: ``junit_family=xunit1``, the JUnit report's): the entry's id, its reason, and its why_not_strict (only
#: for a ``strict = false`` entry: its presence is what marks the test's known failure as non-strict).
ENTRY_PROPERTY = "known_failure_entry"
REASON_PROPERTY = "known_failure_reason"
WHY_NOT_STRICT_PROPERTY = "known_failure_why_not_strict"


class ExpectationFileError(ValueError):
    """The expectations file cannot be read or has a malformed entry."""


@dataclass(frozen=True)
class Expectation:
    kind: str  # "xfail" or "unsupported"
    id: str  # test-id prefix, relative to the rootdir
    reason: str
    link: str | None = None
    match: str | None = None  # xfail only: a regex the failure's message must contain
    evidence: str | None = None
    strict: bool = True  # xfail only: False gives xfail(strict=False), a pass is XPASS, not a failure
    why_not_strict: str | None = None  # required with strict=False: why the failure does not show every run

    def describe(self) -> str:
        return self.reason + (f" ({self.link})" if self.link else "")

    def xfail_reason(self) -> str:
        if self.strict:
            return f"known failure: {self.describe()}"
        return f"known failure (non-strict: {self.why_not_strict}): {self.describe()}"


def load_expectations(path: str | Path) -> list[Expectation]:
    """Parse and validate an expectations file; errors name the file and the entry."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ExpectationFileError(f"cannot read expectations file {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ExpectationFileError(f"{path} is not valid TOML: {exc}") from exc
    unknown = set(data) - set(KINDS)
    if unknown:
        raise ExpectationFileError(f"{path}: unknown section(s) {sorted(unknown)}; use [[xfail]] or [[unsupported]]")
    out, seen = [], set()
    for kind in KINDS:
        entries = data.get(kind, [])
        if not isinstance(entries, list):
            raise ExpectationFileError(f"{path}: '{kind}' must be an array of tables ([[{kind}]])")
        for n, entry in enumerate(entries, 1):
            where = f"{path}: [[{kind}]] entry {n}"
            extra = set(entry) - _ALLOWED_KEYS
            if extra:
                raise ExpectationFileError(f"{where}: unknown key(s) {sorted(extra)}; allowed: "
                                           f"{', '.join(sorted(_ALLOWED_KEYS))}")
            for key in ("id", "reason"):
                if not isinstance(entry.get(key), str) or not entry[key].strip():
                    raise ExpectationFileError(f"{where}: '{key}' must be a non-empty string")
            for key in ("link", "match", "evidence"):
                if key in entry and (not isinstance(entry[key], str) or not entry[key].strip()):
                    raise ExpectationFileError(f"{where}: '{key}' must be a non-empty string when given")
            if "match" in entry:
                if kind != "xfail":
                    raise ExpectationFileError(f"{where}: 'match' applies to [[xfail]] entries only")
                try:
                    re.compile(entry["match"])
                except re.error as exc:
                    raise ExpectationFileError(f"{where}: 'match' is not a valid regular expression: {exc}") from exc
            strict, why = entry.get("strict", True), entry.get("why_not_strict")
            if "strict" in entry or "why_not_strict" in entry:
                named = f"{where} (id = {entry['id']!r})"
                if kind != "xfail":
                    raise ExpectationFileError(f"{named}: 'strict' and 'why_not_strict' apply to [[xfail]] entries "
                                               f"only")
                if not isinstance(strict, bool):
                    raise ExpectationFileError(f"{named}: 'strict' must be true or false, not {strict!r}")
                if strict and "why_not_strict" in entry:
                    raise ExpectationFileError(f"{named}: 'why_not_strict' is given but the entry is strict; "
                                               f"add 'strict = false' or remove it")
                if not strict and (not isinstance(why, str) or not why.strip()):
                    raise ExpectationFileError(f"{named}: 'strict = false' needs 'why_not_strict', a non-empty string "
                                               f"saying why the failure does not show on every run")
            if entry["id"] in seen:
                raise ExpectationFileError(f"{where}: id {entry['id']!r} is listed twice")
            seen.add(entry["id"])
            out.append(Expectation(kind, entry["id"], entry["reason"].strip(), entry.get("link"), entry.get("match"),
                                   entry.get("evidence"), strict, why.strip() if why else None))
    return out


def in_scope(entry_id: str, scopes: list[str]) -> bool:
    """Whether the run collected the part of the suite ``entry_id`` points into. ``scopes`` are the run's
    arguments as rootdir-relative ids ("" = everything), e.g. ``conformance`` or a single test's id:
    a run of one test cannot judge entries for the others, so those are not called stale."""
    for scope in scopes:
        if scope == "" or entry_id == scope:
            return True
        if entry_id.startswith(scope) and entry_id[len(scope)] in "/:[":
            return True
    return False


def _scopes(config: pytest.Config) -> list[str]:
    root = config.rootpath.resolve()
    scopes = []
    for arg in config.args:
        path, sep, rest = arg.partition("::")
        absolute = (config.invocation_params.dir / path).resolve()
        try:
            rel = absolute.relative_to(root).as_posix()
        except ValueError:
            continue  # outside the rootdir: no entry can point there
        rel = "" if rel == "." else rel
        scopes.append(rel + sep + rest)
    return scopes


class ExpectationSet:
    def __init__(self, path: Path, entries: list[Expectation]) -> None:
        self.path, self.entries = path, entries

    def match(self, nodeid: str) -> list[Expectation]:
        return [e for e in self.entries if nodeid.startswith(e.id)]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("nvfp4", "NVFP4 W4A16 conformance")
    group.addoption(
        "--expectations",
        default=None,
        metavar="FILE",
        help="TOML file of this backend's known failures ([[xfail]], strict unless strict = false) and unsupported "
        "cases ([[unsupported]], skipped), by test-id prefix; an entry matching no test fails the run",
    )


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--expectations")
    if not path:
        return
    try:
        entries = load_expectations(path)
    except ExpectationFileError as exc:
        raise pytest.UsageError(str(exc)) from exc
    config.stash[_KEY] = ExpectationSet(Path(path), entries)


def pytest_report_header(config: pytest.Config) -> str | None:
    exp = config.stash.get(_KEY, None)
    if exp is None:
        return None
    return f"nvfp4 expectations: {exp.path} ({len(exp.entries)} entries)"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]):
    exp = config.stash.get(_KEY, None)
    if exp is None:
        return (yield)
    # Before -k/-m deselection: an entry for a test this tier does not run is not stale.
    used: set[Expectation] = set()
    for item in items:
        matches = exp.match(item.nodeid)
        used.update(matches)
        unsupported = [e for e in matches if e.kind == "unsupported"]
        if unsupported:
            item.add_marker(pytest.mark.skip(reason=f"unsupported: {unsupported[0].describe()}"))
        elif matches:
            entry = matches[0]
            item.add_marker(pytest.mark.xfail(strict=entry.strict, reason=entry.xfail_reason()))
            item.user_properties += [(ENTRY_PROPERTY, entry.id), (REASON_PROPERTY, entry.describe())]
            if not entry.strict:
                item.user_properties.append((WHY_NOT_STRICT_PROPERTY, entry.why_not_strict))
    result = yield
    scopes = _scopes(config)
    for entry in exp.entries:
        if entry not in used and in_scope(entry.id, scopes):
            items.append(StaleExpectation.from_parent(session, entry=entry, source=exp.path))
    return result


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """An expected failure with ``match`` must fail with a message containing the pattern: outermost
    wrapper, so it sees the report after the xfail marker turned the failure into ``xfailed``."""
    report = yield
    exp = item.config.stash.get(_KEY, None)
    if exp is None or call.when != "call" or not getattr(report, "wasxfail", None) or call.excinfo is None:
        return report
    patterns = [e for e in exp.match(item.nodeid) if e.kind == "xfail" and e.match]
    if not patterns:
        return report
    entry = patterns[0]
    message = call.excinfo.exconly()
    if re.search(entry.match, message):
        return report
    report.outcome = "failed"
    del report.wasxfail
    report.longrepr = (f"expected failure failed for another reason than recorded: [[xfail]] id = {entry.id!r} "
                       f"expects a failure matching {entry.match!r}; this one was:\n{message}\n\n{report.longrepr}")
    return report


class StaleExpectationError(AssertionError):
    pass


class StaleExpectation(pytest.Item):
    """A synthetic failing test standing for an expectation entry that matches no collected test."""

    def __init__(self, *, entry: Expectation, source: Path, **kwargs) -> None:
        nodeid = f"{source.as_posix()}::stale[{entry.id}]"
        super().__init__(name=f"stale[{entry.id}]", nodeid=nodeid, **kwargs)
        self.entry, self.source = entry, source
        self.user_properties.append(("area", "expectations"))

    def runtest(self) -> None:
        raise StaleExpectationError(
            f"stale expectation in {self.source}: [[{self.entry.kind}]] id = {self.entry.id!r} matches no "
            f"collected test; remove the entry or fix its id (ids are test-id prefixes relative to the rootdir)"
        )

    def repr_failure(self, excinfo, style=None) -> str:
        return str(excinfo.value)

    def reportinfo(self):
        return self.source, None, f"stale expectation {self.entry.id!r}"
