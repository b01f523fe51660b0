"""Expectation files (--expectations): known failures become strict xfails, unsupported cases skip with
the reason, an expected failure that passes fails the run, and an entry matching no test fails the run,
unless the run did not collect the part of the suite the entry points into. A ``strict = false`` entry (with
its ``why_not_strict``) is a non-strict xfail: its pass is an XPASS that does not fail the run.

Integration tests run pytest on probe modules in a temporary directory (one of them under pytest-xdist,
so the outcomes are seen through the controller) and read the JSON summary.
Imports conformance._framework: it tests the framework itself."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conformance._framework.expectations import Expectation, ExpectationFileError, in_scope, load_expectations

pytestmark = pytest.mark.integration  # starts servers or whole pytest runs (ci/time_tests.py times them apart)

REPO = Path(__file__).resolve().parents[2]
GATE = REPO / "ci" / "run_conformance.py"

PROBE_DENSE = '''
def test_known_bug():
    assert False, "planted failure"

def test_fixed_bug():
    pass

def test_new_bug():
    assert False, "planted unexpected failure"
'''
PROBE_MOE = '''
def test_moe_case():
    assert False, "would fail: this backend has no MoE"
'''
GOOD = '''
[[xfail]]
id = "test_dense.py::test_known_bug"
reason = "known rounding bug"
link = "https://example.com/issues/1"

[[unsupported]]
id = "test_moe.py::"
reason = "no fused MoE"
'''
BAD = GOOD + '''
[[xfail]]
id = "test_dense.py::test_fixed_bug"
reason = "was broken once"

[[xfail]]
id = "test_dense.py::test_renamed"
reason = "points at a test that no longer exists"
'''
NON_STRICT = '''
[[xfail]]
id = "test_dense.py::test_known_bug"
reason = "known rounding bug"
match = "planted failure"
strict = false
why_not_strict = "shows only when the scheduler batches"

[[xfail]]
id = "test_dense.py::test_fixed_bug"
reason = "batch variant"
strict = false
why_not_strict = "shows only when the scheduler batches"
'''


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["conformance.plugin"]\n')
    (tmp_path / "test_dense.py").write_text(textwrap.dedent(PROBE_DENSE))
    (tmp_path / "test_moe.py").write_text(textwrap.dedent(PROBE_MOE))
    (tmp_path / "good.toml").write_text(GOOD)
    (tmp_path / "bad.toml").write_text(BAD)
    return tmp_path


def run(probe: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--report-dir", "out", *args],
                          cwd=probe, env=_env(), capture_output=True, text=True, timeout=1200)
    path = probe / "out" / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {}
    return proc, {t["nodeid"]: t for t in summary.get("tests", [])}


def test_outcomes_under_xdist(probe):
    proc, tests = run(probe, "--expectations", "bad.toml", "-n", "2")
    assert proc.returncode == 1
    assert tests["test_dense.py::test_known_bug"]["outcome"] == "xfailed"
    assert "known rounding bug (https://example.com/issues/1)" in tests["test_dense.py::test_known_bug"]["message"]
    assert tests["test_dense.py::test_fixed_bug"]["outcome"] == "xpass_strict"  # fixed: the entry must go
    assert tests["test_dense.py::test_new_bug"]["outcome"] == "failed"
    # the repro carries the suite's options (the expectations file decides xfail vs fail) and the backend spec
    # in effect (here the default: reference and FlashInfer), not -n
    assert tests["test_dense.py::test_new_bug"]["repro"] == (
        "python -m pytest test_dense.py::test_new_bug -p no:cacheprovider --expectations bad.toml "
        "--backend reference,flashinfer")
    assert tests["test_moe.py::test_moe_case"]["outcome"] == "skipped"
    assert tests["test_moe.py::test_moe_case"]["message"] == "unsupported: no fused MoE"
    stale = tests["bad.toml::stale[test_dense.py::test_renamed]"]
    assert stale["outcome"] == "failed" and stale["area"] == "expectations" and stale["repro"] is None
    assert "matches no collected test" in stale["message"]


def test_covered_failures_pass_the_run(probe):
    proc, tests = run(probe, "--expectations", "good.toml", "--deselect", "test_dense.py::test_new_bug")
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert {t["outcome"] for t in tests.values()} == {"xfailed", "passed", "skipped"}


@pytest.mark.parametrize("strict", ["", "strict = true\n"], ids=["default", "explicit"])
def test_strict_xpass_alone_fails_the_run(probe, strict):
    (probe / "xpass.toml").write_text('[[xfail]]\nid = "test_dense.py::test_fixed_bug"\nreason = "r"\n' + strict)
    proc, tests = run(probe, "--expectations", "xpass.toml", "test_dense.py::test_fixed_bug")
    assert proc.returncode == 1 and tests["test_dense.py::test_fixed_bug"]["outcome"] == "xpass_strict"


def test_non_strict_entries_xfail_or_xpass_without_failing_the_run(probe):
    # under xdist, so the outcomes are seen through the controller
    (probe / "nonstrict.toml").write_text(NON_STRICT)
    proc, tests = run(probe, "--expectations", "nonstrict.toml", "test_dense.py", "-k", "known or fixed", "-n", "2")
    assert proc.returncode == 0, proc.stdout[-2000:]
    known, fixed = tests["test_dense.py::test_known_bug"], tests["test_dense.py::test_fixed_bug"]
    assert known["outcome"] == "xfailed"  # failed as recorded: an expected failure, as with a strict entry
    assert known["message"] == "known failure (non-strict: shows only when the scheduler batches): known rounding bug"
    assert fixed["outcome"] == "xpassed" and fixed["repro"] is None  # passed: XPASS, not XPASS(strict)
    assert fixed["message"] == "known failure (non-strict: shows only when the scheduler batches): batch variant"


def test_reports_list_the_non_strict_pass_and_no_other_known_failure(probe):
    """A non-strict entry whose test passed (its known failure did not show) is listed in report.md's own section
    and summary.json's known_failures_not_shown, with the entry's reason and why_not_strict; a non-strict entry
    that failed as recorded and a strict entry that failed are not. The verdict stays PASS."""
    strict = '[[xfail]]\nid = "test_dense.py::test_new_bug"\nreason = "strict one"\n'
    (probe / "mixed.toml").write_text(NON_STRICT + strict)
    proc, tests = run(probe, "--expectations", "mixed.toml", "test_dense.py", "-n", "2")  # through the controller
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert [tests[f"test_dense.py::test_{n}"]["outcome"] for n in ("known_bug", "fixed_bug", "new_bug")] == [
        "xfailed", "xpassed", "xfailed"]
    summary = json.loads((probe / "out" / "summary.json").read_text())
    assert summary["verdict"] == "pass"
    assert summary["known_failures_not_shown"] == [{
        "nodeid": "test_dense.py::test_fixed_bug", "backend": "-", "tier": "cpu",
        "entry": "test_dense.py::test_fixed_bug", "reason": "batch variant",
        "why_not_strict": "shows only when the scheduler batches"}]
    markdown = (probe / "out" / "report.md").read_text()
    assert "**Verdict: PASS**" in markdown and "- Known failures that did not show: 1 " in markdown
    section = markdown.split("\n## Known failures that did not show (non-strict XPASS)\n", 1)[1].split("\n## ", 1)[0]
    assert "If this keeps passing, the engine may have been fixed: remove the entry or make it strict." in section
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert rows == ["| `test_dense.py::test_fixed_bug` | `test_dense.py::test_fixed_bug` | batch variant "
                    "| shows only when the scheduler batches |"]
    assert "known failure did not show (non-strict XPASS, not a failure): test_dense.py::test_fixed_bug" in proc.stdout


def test_non_strict_entry_still_demands_the_recorded_failure(probe):
    (probe / "nonstrict.toml").write_text(
        '[[xfail]]\nid = "test_dense.py::test_new_bug"\nreason = "r"\nmatch = "planted failure$"\n'
        'strict = false\nwhy_not_strict = "timing"\n')
    proc, tests = run(probe, "--expectations", "nonstrict.toml", "test_dense.py::test_new_bug")
    assert proc.returncode == 1
    new = tests["test_dense.py::test_new_bug"]
    assert new["outcome"] == "failed" and "failed for another reason than recorded" in new["message"]


def test_stale_entry_alone_fails_the_run(probe):
    (probe / "stale.toml").write_text('[[unsupported]]\nid = "test_dense.py::test_gone"\nreason = "r"\n')
    proc, tests = run(probe, "--expectations", "stale.toml", "-k", "fixed")
    assert proc.returncode == 1
    assert tests["stale.toml::stale[test_dense.py::test_gone]"]["outcome"] == "failed"


def test_entries_for_deselected_or_uncollected_tests_are_not_stale(probe):
    # -k deselects the xfail'd test; running one file leaves test_moe.py out of scope
    proc, tests = run(probe, "--expectations", "good.toml", "test_dense.py", "-k", "fixed")
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert list(tests) == ["test_dense.py::test_fixed_bug"]


def test_gate_exit_code_follows_expectations(probe, tmp_path_factory):
    out = tmp_path_factory.mktemp("gate")
    base = [sys.executable, str(GATE), "--tier", "cpu", "--rootdir", str(probe), "--tests", ".", "--workers", "0"]
    bad = subprocess.run([*base, "--out", str(out / "bad"), "--expectations", str(probe / "bad.toml")],
                         env=_env(), capture_output=True, text=True, timeout=1200)
    assert bad.returncode == 1 and "xpass_strict: test_dense.py::test_fixed_bug" in bad.stdout
    good = subprocess.run([*base, "--out", str(out / "good"), "--expectations", str(probe / "good.toml"),
                           "--", "--deselect", "test_dense.py::test_new_bug"],
                          env=_env(), capture_output=True, text=True, timeout=1200)
    assert good.returncode == 0, good.stdout[-2000:]
    report = (out / "good" / "report.md").read_text()
    assert "## Expected failures" in report and "known rounding bug" in report


def test_match_demands_the_recorded_failure(probe):
    # both tests fail; only the one whose message has the recorded pattern is an expected failure
    (probe / "match.toml").write_text(
        '[[xfail]]\nid = "test_dense.py::test_known_bug"\nreason = "r"\nmatch = "planted failure"\n'
        'evidence = "a probe"\n'
        '[[xfail]]\nid = "test_dense.py::test_new_bug"\nreason = "r"\nmatch = "planted failure$"\n')
    proc, tests = run(probe, "--expectations", "match.toml", "test_dense.py", "-k", "bug")
    assert proc.returncode == 1
    assert tests["test_dense.py::test_known_bug"]["outcome"] == "xfailed"
    new = tests["test_dense.py::test_new_bug"]
    assert new["outcome"] == "failed" and "failed for another reason than recorded" in new["message"]


def test_malformed_file_is_a_usage_error(probe):
    (probe / "typo.toml").write_text('[[xfail]]\nid = "test_dense.py::x"\nreasn = "typo"\n')
    proc, _ = run(probe, "--expectations", "typo.toml")
    assert proc.returncode == 4  # pytest's usage-error exit status
    assert "unknown key(s) ['reasn']" in proc.stderr


def test_non_strict_without_why_is_a_usage_error(probe):
    (probe / "nowhy.toml").write_text('[[xfail]]\nid = "test_dense.py::test_fixed_bug"\nreason = "r"\nstrict = false\n')
    proc, _ = run(probe, "--expectations", "nowhy.toml")
    assert proc.returncode == 4
    assert ("nowhy.toml: [[xfail]] entry 1 (id = 'test_dense.py::test_fixed_bug'): 'strict = false' needs "
            "'why_not_strict'") in proc.stderr


# ------------------------------------------------------------------------------ parsing
@pytest.mark.parametrize("text,message", [
    ('[[xfail]]\nid = "a"\n', "'reason' must be a non-empty string"),
    ('[[xfail]]\nid = ""\nreason = "r"\n', "'id' must be a non-empty string"),
    ('[[skip]]\nid = "a"\nreason = "r"\n', "unknown section(s) ['skip']"),
    ('xfail = "a"\n', "'xfail' must be an array of tables"),
    ('[[xfail]]\nid = "a"\nreason = "r"\n[[unsupported]]\nid = "a"\nreason = "r"\n', "listed twice"),
    ('[[xfail]\n', "is not valid TOML"),
    ('[[unsupported]]\nid = "a"\nreason = "r"\nmatch = "x"\n', "'match' applies to [[xfail]] entries only"),
    ('[[xfail]]\nid = "a"\nreason = "r"\nmatch = "("\n', "not a valid regular expression"),
    ('[[xfail]]\nid = "a"\nreason = "r"\nevidence = ""\n', "'evidence' must be a non-empty string when given"),
    ('[[xfail]]\nid = "a"\nreason = "r"\nstrict = false\n',
     "[[xfail]] entry 1 (id = 'a'): 'strict = false' needs 'why_not_strict', a non-empty string"),
    ('[[xfail]]\nid = "a"\nreason = "r"\n[[xfail]]\nid = "b"\nreason = "r"\nstrict = false\nwhy_not_strict = " "\n',
     "[[xfail]] entry 2 (id = 'b'): 'strict = false' needs 'why_not_strict'"),
    ('[[xfail]]\nid = "a"\nreason = "r"\nstrict = "no"\nwhy_not_strict = "w"\n', "'strict' must be true or false"),
    ('[[xfail]]\nid = "a"\nreason = "r"\nwhy_not_strict = "w"\n', "'why_not_strict' is given but the entry is strict"),
    ('[[unsupported]]\nid = "a"\nreason = "r"\nstrict = false\nwhy_not_strict = "w"\n',
     "'strict' and 'why_not_strict' apply to [[xfail]] entries only"),
])
def test_load_rejects_bad_files(tmp_path, text, message):
    path = tmp_path / "e.toml"
    path.write_text(text)
    with pytest.raises(ExpectationFileError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_expectations(path)


def test_load_reads_both_kinds(tmp_path):
    path = tmp_path / "e.toml"
    path.write_text(GOOD)
    assert load_expectations(path) == [
        Expectation("xfail", "test_dense.py::test_known_bug", "known rounding bug", "https://example.com/issues/1"),
        Expectation("unsupported", "test_moe.py::", "no fused MoE", None),
    ]


def test_load_reads_non_strict_entries(tmp_path):
    path = tmp_path / "e.toml"
    path.write_text(NON_STRICT + '[[xfail]]\nid = "c"\nreason = "r"\nstrict = true\n')
    known, fixed, explicit = load_expectations(path)
    assert (known.strict, known.why_not_strict, known.match) == (False, "shows only when the scheduler batches",
                                                                 "planted failure")
    assert fixed.xfail_reason() == "known failure (non-strict: shows only when the scheduler batches): batch variant"
    assert explicit == Expectation("xfail", "c", "r") and explicit.xfail_reason() == "known failure: r"


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(ExpectationFileError, match="cannot read expectations file"):
        load_expectations(tmp_path / "nope.toml")


@pytest.mark.parametrize("entry,scopes,expected", [
    ("conformance/dense/test_dense.py::test_a[x]", [""], True),
    ("conformance/dense/test_dense.py::test_a[x]", ["conformance"], True),
    ("conformance/dense/test_dense.py::test_a[x]", ["conformance/dense/test_dense.py"], True),
    ("conformance/dense/test_dense.py::test_a[x]", ["conformance/dense/test_dense.py::test_a"], True),
    ("conformance/dense/test_dense.py::test_a[x]", ["conformance/moe/test_moe.py"], False),
    ("conformance/dense/test_dense.py::test_a[x]", ["conformance/dense/test_dense.py::test_b"], False),
    ("conformance/dense/test_dense.py::test_a[x]", ["conformance/dense/test_dense.py::test_a[y]"], False),
    ("conformance/test_densely.py::t", ["conformance/dense/test_dense.py"], False),
    ("conformance/", ["conformance"], True),
])
def test_in_scope(entry, scopes, expected):
    assert in_scope(entry, scopes) is expected
