"""The upstream-expectations oracle: expectations written by hand from SGLang's own unit tests
(``fixtures/config_rules/upstream_expectations.json``), checked against any rules engine.

Each entry names its source (repository, file, test, the commit it was read at), the rules profiles it holds
for, a ``check`` (which engine question it asks, the same questions the matrices ask), its ``inputs`` and the
expected outcome: ``{"kind": "ok", "value": {...}}`` (the engine's answer must carry these fields with these
values; only what the upstream test asserts is listed) or ``{"kind": "raises", "exc", "match"}``.

Verdicts: ``agree``; ``disagree`` (the message shows both sides); ``n/a`` with the reason: the entry does not
hold for the profile under test, the profile does not model the entry's area (``not_modelled`` in its profile
file), or the engine does not implement the check.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from conformance.interfaces.rules import RulesEngine
from conformance.rules.matrix import FIXTURES, RuleCase, load_matrix, load_profile, outcome_mismatch, run_case, shown

ORACLE_FILE = FIXTURES / "upstream_expectations.json"
AGREE, DISAGREE, NOT_APPLICABLE = "agree", "disagree", "n/a"
SOURCE_FIELDS = ("repo", "file", "test", "commit")

_CONTEXT_FROM = {"derived_param": "derived_param"}  # checks that need a matrix file's context (value shapes)


@dataclass(frozen=True)
class Expectation:
    id: str
    area: str
    source: dict[str, str] = field(hash=False)
    holds_for: tuple[str, ...]
    check: str
    inputs: dict[str, Any] = field(hash=False)
    expect: dict[str, Any] = field(hash=False)
    note: str = ""
    tier: str = "cpu"

    def describe(self, actual: str, profile: str) -> str:
        src = self.source
        return (f"upstream expectation {self.id} ({src['repo']} {src['file']}::{src['test']} @ {src['commit']}; "
                f"holds for {', '.join(self.holds_for)})\n  inputs:   {json.dumps(self.inputs)}\n"
                f"  upstream: {json.dumps(self.expect)}\n  engine:   {actual}  (rules profile {profile})")


def load_expectations() -> list[Expectation]:
    data = json.loads(ORACLE_FILE.read_text())
    return [Expectation(e["id"], e["area"], e["source"], tuple(e["holds_for"]), e["check"], e["inputs"], e["expect"],
                        e.get("note", "")) for e in data["expectations"]]


def _matrix_case(matrix: str, exp: Expectation) -> RuleCase:
    context = load_matrix(matrix)[0].context if matrix in _CONTEXT_FROM else {}
    return RuleCase(matrix, exp.id, exp.inputs, exp.expect, context)


def _lm_head(engine: RulesEngine, i: dict) -> dict:
    return {"apply": bool(engine.lm_head_guard(i["method"], i.get("quant_mode"), i["weight_dtype"], tuple(i["attrs"])))}


# check -> (matrix whose optional engine method it needs, evaluator)
_CHECKS = {
    "lm_head": ("lm_head", lambda e, x: _lm_head(e, x.inputs)),
    "reload": ("reload", lambda e, x: run_case(e, _matrix_case("reload", x))),
    "derived_param": ("derived_param", lambda e, x: run_case(e, _matrix_case("derived_param", x))),
    "fp4_backend": ("fp4_backend", lambda e, x: e.fp4_gemm_backend(x.inputs)),
    "fp4_gemm": ("fp4_gemm", lambda e, x: e.fp4_gemm_dispatch(x.inputs)),
    "moe": ("moe", lambda e, x: e.resolve_moe(x.inputs)),
    "moe_activation": ("moe_activation", lambda e, x: e.moe_activation(x.inputs)),
    "quant_method": ("quant_method", lambda e, x: e.quant_method(x.inputs.get("config_json"),
                                                                  x.inputs.get("hf_quant_config"))),
    "mixed_layers": ("mixed_layers", lambda e, x: e.mixed_layer(x.inputs["quantized_layers"], x.inputs["packed"],
                                                                x.inputs["kind"], x.inputs["prefix"],
                                                                x.inputs.get("name_mapping"))),
    "vllm_linear": ("vllm_linear", lambda e, x: e.vllm_linear_kernel(x.inputs)),
    "vllm_moe": ("vllm_moe", lambda e, x: e.vllm_moe_backend(x.inputs)),
}
CHECKS = tuple(_CHECKS)


def evaluate(engine: RulesEngine, exp: Expectation) -> dict[str, Any] | BaseException:
    """The engine's answer to the entry's question (its value, or the exception it raised)."""
    _, fn = _CHECKS[exp.check]
    try:
        out = fn(engine, exp)
    except Exception as exc:  # noqa: BLE001 - an engine's exception is an outcome to compare
        return exc
    return out


def not_applicable(engine: RulesEngine, exp: Expectation, profile: str) -> str | None:
    if profile not in exp.holds_for:
        return f"holds for {', '.join(exp.holds_for)}; judged under rules profile {profile}"
    not_modelled = load_profile(profile).get("not_modelled", {})
    if exp.area in not_modelled:
        return f"rules profile {profile} does not model {exp.area}: {not_modelled[exp.area]}"
    matrix, _ = _CHECKS[exp.check]
    return engine.unsupported(matrix, exp.inputs)


def judge(engine: RulesEngine, exp: Expectation, profile: str) -> tuple[str, str]:
    """(verdict, detail): detail is the n/a reason, or the two sides of a disagreement."""
    reason = not_applicable(engine, exp, profile)
    if reason:
        return NOT_APPLICABLE, reason
    actual = evaluate(engine, exp)
    want = exp.expect
    if want["kind"] == "ok" and isinstance(actual, dict):
        differs = any(k not in actual or actual[k] != v for k, v in want["value"].items())
    else:
        differs = outcome_mismatch(want, actual)
    if differs:
        return DISAGREE, exp.describe(shown(actual), profile)
    return AGREE, ""


def tally(engine: RulesEngine, profile: str, expectations: list[Expectation] | None = None) -> dict[str, dict[str, int]]:
    """Per area: {"agree": n, "disagree": n, "n/a": n}, plus the disagreement reports under ``"_failures"``."""
    counts: dict[str, dict[str, int]] = {}
    failures: list[str] = []
    for exp in expectations or load_expectations():
        verdict, detail = judge(engine, exp, profile)
        area = counts.setdefault(exp.area, {AGREE: 0, DISAGREE: 0, NOT_APPLICABLE: 0})
        area[verdict] += 1
        if verdict == DISAGREE:
            failures.append(detail)
    return {**counts, "_failures": failures}  # type: ignore[dict-item]
