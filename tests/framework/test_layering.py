"""The layering is declared (import-linter contracts in pyproject.toml) and holds: interfaces <- _framework <- areas
<- adapters, areas independent of each other, adapters importing only interfaces and reference_impl, the self-tests
importing no private framework (tests.framework excepted). A planted upward import in a copy of the packages breaks
the contracts, so the check can fail."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_LINT = ("import sys; from importlinter.cli import lint_imports; "
         "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")

#: (module planted, the import it makes, the contract it must break)
PLANTED = (
    ("conformance/_framework/_planted_upward.py", "import conformance.dense.checks",
     "interfaces <- _framework <- areas <- adapters"),
    ("conformance/moe/_planted_sideways.py", "import conformance.server.workloads",
     "interfaces <- _framework <- areas <- adapters"),
    ("conformance/adapters/vllm/_planted_area.py", "import conformance.engine_harness.checks",
     "adapters import only interfaces and reference_impl"),
    ("conformance/interfaces/_planted_framework.py", "import conformance._framework.selection",
     "interfaces import nothing of the suite above them"),
    ("tests/dense/_planted_private.py", "import conformance._framework.selection",
     "self-tests import no conformance._framework (tests.framework excepted)"),
)


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", _LINT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in ("conformance", "reference_impl", "tests"):  # pyproject's root packages
        shutil.copytree(REPO / package, root / package, ignore=ignore)
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def test_contracts_hold_on_this_tree():
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("path,statement,contract", PLANTED, ids=[p[0].split("/")[-1] for p in PLANTED])
def test_a_planted_wrong_way_import_breaks_the_contracts(tmp_path, path, statement, contract):
    root = _copy(tmp_path)
    assert _lint(root).returncode == 0, "the copy must pass before the import is planted"
    (root / path).write_text(f'"""Planted by tests/framework/test_layering.py."""\n{statement}\n')
    result = _lint(root)
    planted = path.removesuffix(".py").replace("/", ".")
    assert result.returncode != 0, f"{statement} in {path} broke no contract:\n{result.stdout}"
    assert f"{contract}" in result.stdout and "BROKEN" in result.stdout, result.stdout
    assert planted in result.stdout, f"the report does not name {planted}:\n{result.stdout}"
