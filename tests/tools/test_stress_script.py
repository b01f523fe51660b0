"""ci/stress.py counts what pytest reports: a failing and an erroring test are flakes, a passing run has none,
a run that collects nothing is reported as such (exit 2), and the burner is bounded and killed."""
from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stress():
    spec = importlib.util.spec_from_file_location("ci_stress", REPO / "ci" / "stress.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["ci_stress"] = module
    spec.loader.exec_module(module)
    return module


def _write(tmp_path: Path, body: str) -> Path:
    f = tmp_path / "test_planted.py"
    f.write_text(body)
    return f


def test_failures_and_errors_are_counted(stress, tmp_path):
    f = _write(tmp_path, "import pytest\n"
                         "@pytest.fixture\ndef broken():\n    raise RuntimeError('setup')\n"
                         "def test_ok(): pass\n"
                         "def test_fails(): assert False\n"
                         "def test_errors(broken): pass\n"
                         "def test_skipped(): pytest.skip('x')\n")
    r = stress.run_pytest("planted", [str(f), "-p", "no:randomly"], tmp_path)
    assert (r.tests, r.failed, r.errors, r.skipped, r.flakes) == (4, 1, 1, 1, 2)


def test_passing_run_has_no_flakes_in_random_order(stress, tmp_path):
    order = tmp_path / "order.txt"
    f = _write(tmp_path, "".join(f"def test_{i}():\n    open({str(order)!r}, 'a').write('{i} ')\n" for i in range(8)))
    r = stress.run_pytest("clean", [str(f), "-p", "randomly", "--randomly-seed=7"], tmp_path)
    # the inner run's own output says why when it did not run (exit 4 'plugin "randomly"': not installed)
    assert (r.tests, r.flakes, r.returncode) == (8, 0, 0), (tmp_path / "clean.log").read_text()[-3000:]
    ran = [int(i) for i in order.read_text().split()]
    assert sorted(ran) == list(range(8)) and ran != sorted(ran), f"pytest-randomly did not shuffle: {ran}"


def test_empty_run_reports_no_tests(stress, tmp_path):
    f = _write(tmp_path, "X = 1\n")
    r = stress.run_pytest("empty", [str(f)], tmp_path)
    assert r.tests == 0 and r.returncode == 5


def test_burner_is_bounded(stress):
    t0 = time.monotonic()
    (b,) = stress.start_burners(1, seconds=0.5)
    assert b.wait(timeout=30) == 0 and time.monotonic() - t0 < 30


def test_a_missing_plugin_is_named_before_anything_runs(stress, monkeypatch):
    """Without pytest-randomly every order would exit 4 ('Error importing plugin "randomly"'), which reads
    like a flake: the script names the missing plugin and the install command instead, at once."""
    plan = [("order 1", ["tests/", "-p", "randomly"]), ("determinism", ["-p", "repeat", "x.py"])]
    real = stress.importlib.util.find_spec
    monkeypatch.setattr(stress.importlib.util, "find_spec",
                        lambda name, *a: None if name == "pytest_randomly" else real(name, *a))
    assert stress.missing_plugins(plan) == ["pytest_randomly"]
    monkeypatch.setattr(stress.importlib.util, "find_spec", real)
    assert stress.missing_plugins(plan) == []


def test_vllm_runs_whose_outcomes_differ_are_flakes(stress, tmp_path):
    """The vLLM stage repeated: a test that passed in the first run and failed (or was skipped) in a later one
    is counted, as is a gate that failed with nothing failing (an unexpected pass, a stale expectation)."""
    def report(name: str, cases: dict[str, str]) -> Path:
        body = {"passed": "", "failed": "<failure message='x'/>", "skipped": "<skipped message='xfail'/>"}
        xml = "".join(f"<testcase classname='c' name='{k}'>{body[v]}</testcase>" for k, v in cases.items())
        path = tmp_path / f"{name}.xml"
        path.write_text(f"<testsuites><testsuite tests='{len(cases)}'>{xml}</testsuite></testsuites>")
        return path

    first = stress.RunResult("vllm 1", 1.0, 3, 0, 0, 1, 0,
                             stress.junit_outcomes(report("a", {"t1": "passed", "t2": "skipped", "t3": "passed"})))
    assert first.outcomes == {"c::t1": "passed", "c::t2": "skipped", "c::t3": "passed"}
    same = stress.RunResult("vllm 2", 1.0, 3, 0, 0, 1, 0, dict(first.outcomes))
    other = stress.RunResult("vllm 3", 1.0, 3, 0, 0, 2, 0,
                             stress.junit_outcomes(report("b", {"t1": "passed", "t2": "skipped", "t3": "skipped"})))
    assert stress.count_differing(first, same) == 0
    other.differing = stress.count_differing(first, other)
    assert other.differing == 1 and other.flakes == 1
    assert stress.RunResult("vllm 4", 1.0, 3, 0, 0, 1, 1).flakes == 1  # the gate failed, nothing failed
    assert first.flakes == 0


def _case(name: str, child: str = "", why_not_strict: bool = False) -> str:
    prop = "<properties><property name='known_failure_why_not_strict' value='w'/></properties>"
    return f"<testcase classname='c' name='{name}'>{prop if why_not_strict else ''}{child}</testcase>"


XFAILED = "<skipped type='pytest.xfail' message='known failure'/>"


def test_non_strict_known_failure_xfailed_or_xpassed_is_one_outcome(stress, tmp_path):
    """A test of a non-strict [[xfail]] entry flips between xfailed and xpassed by design: not a flake. The same
    flip without the entry, or that test turning failed, still is; a plain skip is not an xfail."""
    def outcomes(name: str, cases: list[str]) -> dict[str, str]:
        path = tmp_path / f"{name}.xml"
        path.write_text(f"<testsuites><testsuite>{''.join(cases)}</testsuite></testsuites>")
        return stress.junit_outcomes(path)

    first = outcomes("first", [_case("ns", XFAILED, True), _case("strict", XFAILED), _case("skip", "<skipped/>"),
                               _case("plain", "")])
    assert first == {"c::ns": stress.NON_STRICT_XFAIL, "c::strict": "xfailed", "c::skip": "skipped",
                     "c::plain": "passed"}
    same = outcomes("same", [_case("ns", "", True), _case("strict", XFAILED), _case("skip", "<skipped/>"),
                             _case("plain", "")])
    assert same == first
    flipped = outcomes("flipped", [_case("ns", "<failure message='x'/>", True), _case("strict", ""),
                                   _case("skip", XFAILED), _case("plain", "<failure message='x'/>")])
    run = lambda name, o: stress.RunResult(name, 1.0, 4, 0, 0, 0, 0, o)  # noqa: E731
    assert stress.count_differing(run("vllm 1", first), run("vllm 2", same)) == 0
    assert stress.count_differing(run("vllm 1", first), run("vllm 3", flipped)) == 4


def test_non_strict_flip_in_real_runs_is_not_a_flake_but_a_plain_one_is(stress, tmp_path):
    """End to end: two pytest runs under a non-strict entry, the covered test passing in one and failing as
    recorded in the other, read back from their JUnit reports (the entry's property travels with xunit1); a
    test without an entry that flips passed -> failed is the one difference counted."""
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["conformance.plugin"]\n')
    _write(tmp_path, "from pathlib import Path\nFLAG = Path(__file__).with_name('fail.flag')\n"
                     "def test_batch():\n    assert not FLAG.exists(), 'not batch invariant'\n"
                     "def test_plain():\n    assert not FLAG.exists(), 'broken'\n")
    (tmp_path / "exp.toml").write_text('[[xfail]]\nid = "test_planted.py::test_batch"\nreason = "r"\n'
                                       'match = "not batch invariant"\nstrict = false\nwhy_not_strict = "scheduling"\n')
    # rootdir = tmp_path: the entry's id is relative to it wherever the checkout lies (from the repository's
    # rootdir a test outside it gets a node id that depends on where the two directories are, e.g. under one /tmp)
    args = [str(tmp_path / "test_planted.py"), "--rootdir", str(tmp_path), "-p", "no:randomly",
            "-o", "junit_family=xunit1", "--expectations", str(tmp_path / "exp.toml")]
    passing = stress.run_pytest("vllm 1", args, tmp_path)
    (tmp_path / "fail.flag").write_text("")
    failing = stress.run_pytest("vllm 2", args, tmp_path)
    assert (passing.returncode, failing.returncode) == (0, 1), (tmp_path / "vllm-2.log").read_text()[-3000:]
    first = stress.RunResult("vllm 1", 1.0, 2, 0, 0, 0, 0, stress.junit_outcomes(tmp_path / "vllm-1.xml"))
    later = stress.RunResult("vllm 2", 1.0, 2, 1, 0, 0, 1, stress.junit_outcomes(tmp_path / "vllm-2.xml"))
    batch = next(k for k in first.outcomes if k.endswith("::test_batch"))
    plain = next(k for k in first.outcomes if k.endswith("::test_plain"))
    assert first.outcomes[batch] == later.outcomes[batch] == stress.NON_STRICT_XFAIL
    assert (first.outcomes[plain], later.outcomes[plain]) == ("passed", "failed")
    assert stress.count_differing(first, later) == 1
