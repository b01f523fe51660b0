"""The vendor interfaces live in one place (conformance/interfaces/) and ``--engine`` names either engine
interface: a ``module:attr`` that implements only the configuration rules runs the rule tests and skips the
engine-harness tests with the reason (and the other way round), instead of stopping the run."""
from __future__ import annotations

import abc
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.engine_harness import NotALayerCodeEngine, load_layer_code_engine
from conformance.interfaces.kernel import Backend
from conformance.interfaces.layer_code import LayerCodeEngine
from conformance.interfaces.rules import RulesEngine
from conformance.interfaces.server import ServerDialect

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("interface", [Backend, RulesEngine, LayerCodeEngine, ServerDialect], ids=lambda c: c.__name__)
def test_each_interface_is_one_documented_abstract_class(interface) -> None:
    assert isinstance(interface, abc.ABCMeta) and interface.__abstractmethods__
    assert interface.__module__.startswith("conformance.interfaces.")
    undocumented = [m for m in interface.__abstractmethods__ if not (getattr(interface, m).__doc__ or "").strip()
                    and m not in ("forward_dense",)]  # forward_dense: its signature says it all
    assert not undocumented, f"{interface.__name__}: abstract methods without a docstring: {undocumented}"


def test_rules_engine_is_not_a_layer_code_engine() -> None:
    with pytest.raises(NotALayerCodeEngine, match="is not a LayerCodeEngine"):
        load_layer_code_engine("conformance.rules.reference:ReferenceRules")


@pytest.mark.integration
def test_engine_option_naming_rules_only_skips_the_harness_with_the_reason() -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
           "conformance/engine_harness/test_engine_integration.py", "conformance/rules/test_lm_head_guard.py",
           "--engine", "conformance.rules.reference:ReferenceRules"]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "is not a LayerCodeEngine" in run.stdout and " passed" in run.stdout, run.stdout[-3000:]
