"""reference_impl is grouped by topic; every 0.2 module name still imports, as the very same module object (so an
import or a monkeypatch written against 0.2 keeps working), and the old names are not files any more."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import reference_impl

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("old,new", sorted(reference_impl.MOVED.items()))
def test_old_name_is_the_new_module(old, new):
    moved = importlib.import_module(f"reference_impl.{new}")
    assert importlib.import_module(f"reference_impl.{old}") is moved
    assert getattr(reference_impl, old) is moved  # `from reference_impl import <old>` too
    assert not (REPO / "reference_impl" / f"{old}.py").exists(), f"reference_impl/{old}.py is back: one home each"


def test_old_names_import_first_in_a_fresh_process():
    """Importing an old name before anything else (no new-name import to lean on) works, for each of them."""
    code = ("import importlib, reference_impl\n"
            "for old, new in reference_impl.MOVED.items():\n"
            "    assert importlib.import_module('reference_impl.' + old).__name__ == 'reference_impl.' + new, old\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
