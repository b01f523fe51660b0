"""Load the rule matrices of ``fixtures/config_rules/`` as cases and check one case against an engine.

A failure message always carries the case's inputs, the expected outcome and the actual one.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..engine import RulesEngine

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "config_rules"
MATRICES = ("dense", "fp4_gemm", "moe", "a2a", "fusion", "lm_head", "reload")


@dataclass(frozen=True)
class RuleCase:
    matrix: str
    id: str
    inputs: dict[str, str] = field(hash=False)
    expected: dict[str, Any] = field(hash=False)
    context: dict[str, Any] = field(hash=False, default_factory=dict)
    tier: str = "cpu"

    def describe(self, actual: str) -> str:
        return (f"{self.matrix}[{self.id}]\n  inputs:   {json.dumps(self.inputs)}\n"
                f"  expected: {json.dumps(self.expected)}\n  actual:   {actual}")


def load_matrix(name: str) -> list[RuleCase]:
    data = json.loads((FIXTURES / f"{name}.json").read_text())
    context = {k: v for k, v in data.items() if k not in ("cases", "matrix", "generated_by", "axes")}
    return [RuleCase(name, c["id"], c["inputs"], c["expected"], context) for c in data["cases"]]


# ---- running a case -------------------------------------------------------------------------------------

_DTYPES = {"bfloat16": torch.bfloat16, "uint8": torch.uint8, "int32": torch.int32,
           "float8_e4m3fn": torch.float8_e4m3fn}


def _lm_head(engine: RulesEngine, case: RuleCase) -> dict[str, Any]:
    method, mode = case.context["methods"][case.inputs["method"]]
    dtype, attrs = case.context["head_states"][case.inputs["head"]]
    return {"apply": bool(engine.lm_head_guard(method, mode, dtype, tuple(attrs)))}


def _reload(engine: RulesEngine, case: RuleCase) -> dict[str, Any]:
    """Existing bf16 [4, 8] state under ``w``; the new value is the same, reshaped, or retyped, and filled
    with values that differ from the old ones so that a copy is observable."""
    module = torch.nn.Module()
    old = torch.arange(32, dtype=torch.bfloat16).reshape(4, 8)
    existing = case.inputs["existing"]
    if existing == "parameter":
        module.w = torch.nn.Parameter(old.clone(), requires_grad=False)
    elif existing == "plain_tensor":
        module.w = old.clone()  # a plain attribute, not a Parameter
    before = getattr(module, "w", None)
    before_ptr = before.data_ptr() if before is not None else None
    new = {"same": old + 100, "shape": torch.full((8, 8), 7.0, dtype=torch.bfloat16),
           "dtype": (old + 100).to(torch.float32)}[case.inputs["new"]]
    engine.reload_param(module, "w", new, graph_captured=case.inputs["graph_captured"] == "yes")
    after = module.w
    if not isinstance(after, torch.nn.Parameter):
        raise AssertionError(f"module.w is a {type(after).__name__} after reload, not a Parameter")
    if after.requires_grad:
        raise AssertionError("reloaded Parameter requires grad")
    if not torch.equal(after.data, new):
        raise AssertionError("reloaded Parameter does not hold the new values")
    same_object = after is before
    same_ptr = same_object and after.data_ptr() == before_ptr
    action = "create" if not isinstance(before, torch.nn.Parameter) else ("copy" if same_ptr else "rebind")
    return {"action": action, "same_object": same_object, "same_data_ptr": same_ptr}


_DISPATCH = {
    "dense": lambda e, c: e.resolve_dense(c.inputs),
    "fp4_gemm": lambda e, c: e.fp4_gemm_dispatch(c.inputs),
    "moe": lambda e, c: e.resolve_moe(c.inputs),
    "a2a": lambda e, c: e.validate_a2a(c.inputs),
    "fusion": lambda e, c: e.fusion_enabled(c.inputs),
    "lm_head": _lm_head,
    "reload": _reload,
}


def run_case(engine: RulesEngine, case: RuleCase) -> dict[str, Any] | BaseException:
    """The engine's outcome: its value, or the exception it raised."""
    try:
        return _DISPATCH[case.matrix](engine, case)
    except Exception as exc:  # noqa: BLE001 - an engine's exception is an outcome to compare
        return exc


def mismatch(case: RuleCase, actual: dict[str, Any] | BaseException) -> str | None:
    """``None`` if ``actual`` is the expected outcome, otherwise a readable report."""
    exp = case.expected
    if isinstance(actual, BaseException):
        shown = f"raised {type(actual).__name__}: {actual}"
        if exp["kind"] == "ok":
            return case.describe(shown)
        is_expected_type = exp["exc"] in {k.__name__ for k in type(actual).__mro__}
        if not is_expected_type or not re.search(exp["match"], str(actual)):
            return case.describe(shown)
        return None
    if exp["kind"] != "ok" or actual != exp["value"]:
        return case.describe(f"returned {json.dumps(actual)}")
    return None


def check_case(engine: RulesEngine, case: RuleCase) -> None:
    """Raise AssertionError (with inputs, expected, actual) unless the engine's outcome is the expected one."""
    problem = mismatch(case, run_case(engine, case))
    if problem:
        raise AssertionError(problem)
