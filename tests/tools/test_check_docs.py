"""docs/checks.md is what ci/write_check_docs.py generates from the check registry and the mutants: the docs'
tables of tests, checks and mutants are never kept by hand."""
from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _writer():
    spec = importlib.util.spec_from_file_location("write_check_docs", REPO / "ci" / "write_check_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checks_doc_is_generated_from_the_registry():
    writer = _writer()
    expected = writer.render()
    assert (REPO / "docs" / "checks.md").read_text() == expected, (
        "docs/checks.md is stale: run `python ci/write_check_docs.py` (it is generated from the check registry "
        "and the mutants' caught_by)")


def test_every_mutant_names_a_registered_check():
    from conformance._framework.checks import get_check  # private: the check registry docs/checks.md is written from

    writer = _writer()
    for area, _, mutants in writer.AREAS:
        for mutant in (mutants.MUTANTS if mutants else ()):
            get_check(area, mutant.caught_by)  # KeyError naming the registered checks otherwise
