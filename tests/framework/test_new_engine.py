"""Adding an engine takes one folder and one row of the selection table (``conformance._framework.selection.BUILTINS``),
and nothing else: this test writes a stand-in engine as a folder outside the repository (its configuration rules
and its layer code, each a plain subclass of a built-in), adds its row from a pytest plugin with
``conformance.testing.register``, and runs the rule and engine-harness tests with ``--engine standin``. Both interfaces
must run (rule cases pass and report the stand-in as the engine; harness cases pass through the stand-in's
adapter), and naming an interface the row does not have must skip with the reason."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # whole pytest runs

REPO = Path(__file__).resolve().parents[2]

FOLDER = {
    "__init__.py": '"""A stand-in engine: the whole of what a new engine adds (plus its row in plugin.py)."""\n',
    "rules.py": '''
        from conformance.adapters.reference.rules import ReferenceRules


        class StandInRules(ReferenceRules):
            name = "standin"

            def version(self) -> str:
                return "standin 0.0 (the reference rules)"
        ''',
    "layer_code.py": '''
        from conformance.adapters.sglang.layer_code import SGLangLayerCode


        class StandInLayerCode(SGLangLayerCode):
            """SGLang's layer code under another name: the harness must reach it through the new row only."""
            name = "standin"
        ''',
    # the one table row
    "plugin.py": '''
        from conformance.testing import Builtin, register

        register(Builtin("standin", {"rules": "standin.rules:StandInRules",
                                     "layer_code": "standin.layer_code:StandInLayerCode"}))
        ''',
}


@pytest.fixture(scope="module")
def engine_folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("new-engine")
    (root / "standin").mkdir()
    for name, text in FOLDER.items():
        (root / "standin" / name).write_text(textwrap.dedent(text).lstrip("\n"))
    return root


def _pytest(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(REPO)])}
    env.pop("NVFP4_CONFORMANCE_ENGINE", None)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "standin.plugin", "-q", "-rs",
           "--engine", "standin", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_a_new_engine_is_one_folder_and_one_row(engine_folder) -> None:
    pytest.importorskip("sglang", reason="the stand-in's layer code is SGLang's (the test extra installs it)")
    run = _pytest(engine_folder, "conformance/rules/test_lm_head_guard.py",
                  "conformance/engine_harness/test_engine_integration.py", "-k", "lm_head or dense_integration",
                  "-m", "not b200", "--junitxml", str(engine_folder / "junit.xml"), "-o", "junit_family=xunit1")
    out = run.stdout[-4000:] + run.stderr[-2000:]
    assert run.returncode == 0, out
    junit = (engine_folder / "junit.xml").read_text()
    rules_cases = junit.count('name="rules_engine" value="standin (standin 0.0 (the reference rules))"')
    harness_cases = junit.count('classname="conformance.engine_harness.test_engine_integration"')
    assert rules_cases > 0, f"no rule case ran on the stand-in:\n{out}"
    assert harness_cases > 0 and "engine 'standin' not runnable" not in run.stdout, out
    assert " failed" not in run.stdout and " error" not in run.stdout, out


def test_an_interface_the_row_lacks_skips_with_the_reason(engine_folder) -> None:
    (engine_folder / "rules_only").mkdir(exist_ok=True)
    (engine_folder / "rules_only" / "__init__.py").write_text("")
    (engine_folder / "rules_only" / "plugin.py").write_text(
        "from conformance.testing import Builtin, register\n"
        "register(Builtin('standin', {'rules': 'conformance.adapters.reference.rules:ReferenceRules'}))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(engine_folder), str(REPO)])}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "rules_only.plugin", "-q", "-rs",
           "--engine", "standin", "conformance/engine_harness/test_engine_integration.py", "-k", "dense_integration",
           "-m", "not b200"]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0 and " passed" not in run.stdout, out
    assert "implements ['rules'], not layer_code" in run.stdout, out
