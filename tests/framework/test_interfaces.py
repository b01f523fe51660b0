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

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("interface", [Backend, RulesEngine, LayerCodeEngine, ServerDialect], ids=lambda c: c.__name__)
def test_each_interface_is_one_documented_abstract_class(interface) -> None:
    assert isinstance(interface, abc.ABCMeta) and interface.__abstractmethods__
    assert interface.__module__.startswith("conformance.interfaces.")
    undocumented = [m for m in interface.__abstractmethods__ if not (getattr(interface, m).__doc__ or "").strip()
                    and m not in ("forward_dense",)]  # forward_dense: its signature says it all
    assert not undocumented, f"{interface.__name__}: abstract methods without a docstring: {undocumented}"


def test_rules_engine_is_not_a_layer_code_engine() -> None:
    with pytest.raises(NotALayerCodeEngine, match="is not a LayerCodeEngine"):
        load_layer_code_engine("conformance.adapters.reference.rules:ReferenceRules")


@pytest.mark.integration
def test_engine_option_naming_rules_only_skips_the_harness_with_the_reason() -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
           "conformance/engine_harness/test_engine_integration.py", "conformance/rules/test_lm_head_guard.py",
           "--engine", "conformance.adapters.reference.rules:ReferenceRules"]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "is not a LayerCodeEngine" in run.stdout and " passed" in run.stdout, run.stdout[-3000:]


def test_0_1_interface_modules_are_deprecated_aliases() -> None:
    """0.1 adapters keep working: ``conformance.adapter`` / ``conformance.engine`` give the very same classes,
    with a DeprecationWarning naming the new module; an error under ``-W error::DeprecationWarning``."""
    import importlib

    for old, new, names in [("conformance.adapter", "conformance.interfaces.kernel",
                             ["Backend", "CaseInfo", "DenseLayer", "MoEExperts"]),
                            ("conformance.engine", "conformance.interfaces.rules", ["RulesEngine"])]:
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
            module = importlib.import_module(old)
        current = importlib.import_module(new)
        assert all(getattr(module, n) is getattr(current, n) for n in names)
        strict = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", f"import {old}"],
                                cwd=REPO, capture_output=True, text=True)
        assert strict.returncode != 0 and "DeprecationWarning" in strict.stderr and new in strict.stderr
    from conformance.engine_harness import core

    with pytest.warns(DeprecationWarning, match=r"conformance\.interfaces\.layer_code\.LayerCodeEngine"):
        assert core.EngineAdapter is LayerCodeEngine


def test_option_help_states_the_real_defaults() -> None:
    """Each option whose default is computed says the value the code uses (not an older one)."""
    from conformance.backends import DEFAULT_BACKEND
    from conformance.engine_harness import DEFAULT_ENGINE as HARNESS_DEFAULT
    from conformance.rules import DEFAULT_ENGINE as RULES_DEFAULT
    from conformance.server.plugin import START_TIMEOUT_S

    out = subprocess.run([sys.executable, "-m", "pytest", "--help", "-p", "no:cacheprovider"], cwd=REPO,
                         capture_output=True, text=True, timeout=120).stdout
    text = " ".join(out.split())  # argparse wraps help lines
    assert f"or '{DEFAULT_BACKEND}'" in text
    assert f"else '{RULES_DEFAULT}' for the rules and '{HARNESS_DEFAULT}' for the harness" in text
    assert f"healthy, in seconds (default {START_TIMEOUT_S:g})" in text
