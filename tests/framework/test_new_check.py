"""Adding a dense check is one function with ``@check``, one mutant naming it and one correct variant; nothing
else is edited. This test writes the three into a module outside the repository (as a contributor's new code)
and shows: the registry has the check, the mutant runner's ``failing_checks`` reports it on the mutant only, the
generated docs table lists it, and ``pytest conformance/dense`` runs it (the module loaded as a plugin) and fails
the mutant with its message while the variant passes. Imports conformance._framework: it tests the framework itself."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

NEW_CHECK = textwrap.dedent('''
    import torch

    from conformance._framework.checks import check
    from tests.dense.mutants import PlainDense


    @check("dense")
    def check_output_contiguous(run):
        """The output is a contiguous tensor (the next layer reads it as laid out)."""
        assert run.y.is_contiguous(), f"output is not contiguous: shape {tuple(run.y.shape)}, stride {run.y.stride()}"


    class OutputNotContiguous(PlainDense):
        """Returns the right values in a transposed layout."""

        caught_by = "check_output_contiguous"

        def run_dense(self, prepared, x):
            y = super().run_dense(prepared, x)
            return y.transpose(-1, -2).contiguous().transpose(-1, -2)


    class ContiguousOutput(PlainDense):
        """The plain layer: contiguous output."""
''')

IN_PROCESS = textwrap.dedent('''
    import newcheck
    from conformance._framework.checks import get_check
    from conformance.dense.cases import CPU_CASES
    from conformance.dense.checks import failing_checks

    case = next(c for c in CPU_CASES if c.id == "cpu-m7-n160-k256")
    assert get_check("dense", "check_output_contiguous").test == "test_dense_matches_reference"
    assert "check_output_contiguous" in failing_checks(newcheck.OutputNotContiguous(), case)
    assert failing_checks(newcheck.ContiguousOutput(), case) == {}
    import importlib.util
    spec = importlib.util.spec_from_file_location("w", "ci/write_check_docs.py")
    w = importlib.util.module_from_spec(spec); spec.loader.exec_module(w)
    assert "| `check_output_contiguous` | `test_dense_matches_reference` |" in w.render()
    print("IN-PROCESS OK")
''')


def _run(args, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NVFP4_CONFORMANCE_BACKEND"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO)])
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.integration
def test_a_new_dense_check_is_one_function_one_mutant_one_variant(tmp_path):
    (tmp_path / "newcheck.py").write_text(NEW_CHECK)
    result = _run(["-c", IN_PROCESS], tmp_path)
    assert "IN-PROCESS OK" in result.stdout, result.stdout + result.stderr
    select = ["-m", "pytest", "conformance/dense/test_dense.py", "-p", "newcheck", "-m", "cpu", "-q",
              "-p", "no:cacheprovider", "-k", "test_dense_matches_reference and cpu-m7-n160-k256"]
    mutant = _run([*select, "--backend", "newcheck:OutputNotContiguous"], tmp_path)
    assert mutant.returncode == 1 and "output is not contiguous" in mutant.stdout, mutant.stdout + mutant.stderr
    variant = _run([*select, "--backend", "newcheck:ContiguousOutput"], tmp_path)
    assert variant.returncode == 0 and "1 passed" in variant.stdout, variant.stdout + variant.stderr
