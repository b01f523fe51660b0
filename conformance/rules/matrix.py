"""Load the rule matrices of ``fixtures/config_rules/`` as cases and check one case against an engine.

Each case carries the default profile's expected outcome and, per other rules profile, the outcome that
profile overrides it with (``fixtures/config_rules/profiles/``). A failure message always carries the case's
inputs, the expected outcome (and the profile it is from) and the actual one.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from conformance._framework.data import data_path
from conformance.interfaces.rules import RulesEngine

FIXTURES = data_path("config_rules")
PROFILES_DIR = FIXTURES / "profiles"
DEFAULT_PROFILE = "sglang-0.5.23"
MATRICES = ("dense", "fp4_gemm", "fp4_backend", "moe", "a2a", "fusion", "moe_activation", "fp4_dispatch",
            "quant_method", "mixed_layers", "lm_head", "reload", "derived_param", "env_flags",
            "vllm_linear", "vllm_moe")


@functools.lru_cache(maxsize=None)
def load_profile(name: str) -> dict[str, Any]:
    """A rules profile's file (sources, what it stands for, overrides per matrix); ValueError if unknown."""
    path = PROFILES_DIR / f"{name}.json"
    if not path.is_file():
        known = sorted(p.stem for p in PROFILES_DIR.glob("*.json"))
        raise ValueError(f"unknown rules profile {name!r}: use one of {known}")
    return json.loads(path.read_text())


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


@dataclass(frozen=True)
class RuleCase:
    matrix: str
    id: str
    inputs: dict[str, str] = field(hash=False)
    expected: dict[str, Any] = field(hash=False)
    context: dict[str, Any] = field(hash=False, default_factory=dict)
    tier: str = "cpu"
    overrides: dict[str, dict[str, Any]] = field(hash=False, default_factory=dict)  # profile -> expected
    #: the profiles whose outcomes ``expected`` holds (a matrix of another engine's rules names them); empty:
    #: the default profile's, overridden per profile
    profiles: tuple[str, ...] = ()

    def not_modelled(self, profile: str) -> str | None:
        """Why ``profile`` has no expected outcome for this case (``None``: it has one)."""
        if self.profiles and profile not in self.profiles:
            return (f"matrix {self.matrix} holds the rules of {', '.join(self.profiles)}; rules profile {profile} "
                    f"does not model it")
        own = load_profile(profile).get("matrices")
        if own is not None and self.matrix not in own:
            return f"rules profile {profile} models only the matrices {', '.join(own)}, not {self.matrix}"
        return None

    def expected_for(self, profile: str = DEFAULT_PROFILE) -> dict[str, Any]:
        load_profile(profile)  # an unknown profile is an error, not silently the default
        reason = self.not_modelled(profile)
        if reason:
            raise LookupError(reason)
        return self.overrides.get(profile, self.expected)

    def describe(self, actual: str, profile: str = DEFAULT_PROFILE) -> str:
        return (f"{self.matrix}[{self.id}]\n  inputs:   {json.dumps(self.inputs)}\n"
                f"  expected: {json.dumps(self.expected_for(profile))} (rules profile {profile})\n"
                f"  actual:   {actual}")


def load_matrix(name: str) -> list[RuleCase]:
    data = json.loads((FIXTURES / f"{name}.json").read_text())
    context = {k: v for k, v in data.items()
               if k not in ("cases", "matrix", "generated_by", "axes", "excluded", "profiles", "about")}
    by_profile = {p: load_profile(p)["overrides"].get(name, {}) for p in profile_names()}
    profiles = tuple(data.get("profiles", ()))
    return [RuleCase(name, c["id"], c["inputs"], c["expected"], context,
                     overrides={p: o[c["id"]] for p, o in by_profile.items() if c["id"] in o}, profiles=profiles)
            for c in data["cases"]]


# ---- running a case -------------------------------------------------------------------------------------

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


def _derived(engine: RulesEngine, case: RuleCase) -> dict[str, Any]:
    """Source ``src`` (bf16 [4, 8], or fp32, or a plain tensor, or absent) and a derived value (see
    ``values``) bound as ``derived``; ``derived_before=bound``: a previous load left a Parameter of the
    value's shape and dtype there. Reports how ``derived`` ended up bound and what happened to the source."""
    module = torch.nn.Module()
    src = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    source = case.inputs["source"]
    if source in ("parameter", "parameter_other_dtype"):
        dtype = torch.bfloat16 if source == "parameter" else torch.float32
        module.src = torch.nn.Parameter(src.to(dtype), requires_grad=False)
    elif source == "plain_tensor":
        module.src = src.to(torch.bfloat16)
    source_before = module.src.detach().clone() if hasattr(module, "src") else None
    value = torch.full(case.context["values"][case.inputs["value"]], 5.0, dtype=torch.bfloat16)
    if case.inputs["derived_before"] == "bound":
        module.derived = torch.nn.Parameter(torch.zeros_like(value), requires_grad=False)
    before = getattr(module, "derived", None)
    before_ptr = before.data_ptr() if before is not None else None
    engine.bind_derived_param(module, "src", "derived", value)
    after = module.derived
    if not isinstance(after, torch.nn.Parameter) or after.requires_grad:
        raise AssertionError(f"module.derived is {type(after).__name__} (requires_grad "
                             f"{getattr(after, 'requires_grad', None)}), not a frozen Parameter")
    aliased = after is getattr(module, "src", None)
    want = torch.broadcast_to(value, after.shape) if aliased else value
    if after.shape != want.shape or not torch.equal(after.data, want):
        raise AssertionError("module.derived does not hold the derived value")
    if before is None:
        derived = "created"
    elif aliased:
        derived = "alias"
    elif after is before:
        derived = "copied_in_place" if after.data_ptr() == before_ptr else "rebound"
    else:
        derived = "replaced"
    if source_before is None:
        source_state = "absent"
    elif torch.equal(module.src.detach(), source_before):
        source_state = "unchanged"
    else:
        source_state = "filled"
    return {"derived": "alias" if aliased else derived, "source": source_state}


def _quant_method(engine: RulesEngine, case: RuleCase) -> dict[str, Any]:
    config = case.context["checkpoints"][case.inputs["quant_algo"]][case.inputs["location"]]
    return engine.quant_method(config["config_json"], config["hf_quant_config"])


def _mixed(engine: RulesEngine, case: RuleCase) -> dict[str, Any]:
    kind, prefix = case.context["modules"][case.inputs["module"]]
    layers = case.context["checkpoints"][case.inputs["naming"]][case.inputs["format"]]
    return engine.mixed_layer(layers, case.context["packed"], kind, prefix)


def _env_flag(engine: RulesEngine, case: RuleCase) -> dict[str, Any]:
    """One env flag spelling, asked through the question the matrix file names for the flag (its fixed inputs
    plus the flag's value, passed on verbatim: the engine parses it, as SGLang parses the variable)."""
    question = case.context["questions"][case.inputs["flag"]]
    inputs = {**question["inputs"], question["flag_input"]: case.inputs["value"]}
    return _DISPATCH[question["matrix"]](engine, RuleCase(question["matrix"], case.id, inputs, case.expected))


_DISPATCH = {
    "dense": lambda e, c: e.resolve_dense(c.inputs),
    "fp4_gemm": lambda e, c: e.fp4_gemm_dispatch(c.inputs),
    "fp4_backend": lambda e, c: e.fp4_gemm_backend(c.inputs),
    "moe": lambda e, c: e.resolve_moe(c.inputs),
    "a2a": lambda e, c: e.validate_a2a(c.inputs),
    "fusion": lambda e, c: e.fusion_enabled(c.inputs),
    "moe_activation": lambda e, c: e.moe_activation(c.inputs),
    "fp4_dispatch": lambda e, c: e.fp4_dispatch(c.inputs),
    "quant_method": _quant_method,
    "mixed_layers": _mixed,
    "lm_head": _lm_head,
    "reload": _reload,
    "derived_param": _derived,
    "env_flags": _env_flag,
    "vllm_linear": lambda e, c: e.vllm_linear_kernel(c.inputs),
    "vllm_moe": lambda e, c: e.vllm_moe_backend(c.inputs),
}


def run_case(engine: RulesEngine, case: RuleCase) -> dict[str, Any] | BaseException:
    """The engine's outcome: its value, or the exception it raised."""
    try:
        return _DISPATCH[case.matrix](engine, case)
    except Exception as exc:  # noqa: BLE001 - an engine's exception is an outcome to compare
        return exc


def outcome_mismatch(expected: dict[str, Any], actual: dict[str, Any] | BaseException) -> bool:
    """True unless ``actual`` is the ``expected`` outcome (``ok``: equal value; else the exception type, by
    name anywhere in its MRO, and a message matching the regex)."""
    if isinstance(actual, BaseException):
        if expected["kind"] == "ok":
            return True
        is_expected_type = expected["exc"] in {k.__name__ for k in type(actual).__mro__}
        return not (is_expected_type and re.search(expected["match"], str(actual)))
    return expected["kind"] != "ok" or actual != expected["value"]


def shown(actual: dict[str, Any] | BaseException) -> str:
    if isinstance(actual, BaseException):
        return f"raised {type(actual).__name__}: {actual}"
    return f"returned {json.dumps(actual)}"


def mismatch(case: RuleCase, actual: dict[str, Any] | BaseException, profile: str = DEFAULT_PROFILE) -> str | None:
    """``None`` if ``actual`` is the outcome ``profile`` expects, otherwise a readable report."""
    if outcome_mismatch(case.expected_for(profile), actual):
        return case.describe(shown(actual), profile)
    return None


def check_case(engine: RulesEngine, case: RuleCase, profile: str = DEFAULT_PROFILE) -> None:
    """Raise AssertionError (with inputs, expected, actual) unless the engine's outcome is the one expected."""
    problem = mismatch(case, run_case(engine, case), profile)
    if problem:
        raise AssertionError(problem)
