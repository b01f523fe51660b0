"""Rules-engine selection: ``--engine NAME`` for a built-in one (the selection table's ``rules`` column,
``conformance/_framework/selection.py``), ``--engine module:attr`` for another.

Built-ins: ``reference`` (reference_impl's rules), ``sglang`` (SGLang 0.5.23's own code on CPU) and ``vllm``
(vLLM 0.32's own kernel selection on CPU).
``attr`` may be a :class:`~conformance.interfaces.rules.RulesEngine` subclass, an instance, or a zero-argument factory.
"""
from __future__ import annotations

from conformance._framework import selection
from conformance._framework.selection import EngineLoadError, EngineUnavailable
from conformance.interfaces.rules import RulesEngine

ENGINE_ENV_VAR = selection.OPTIONS["--engine"].env
DEFAULT_ENGINE = selection.OPTIONS["--engine"].defaults["rules"]
#: built-in name -> ``module:attr`` (a view of the selection table)
BUILTIN_ENGINES = {n: selection.target_of(n, "rules") for n in selection.names_for("rules")}
#: the rules profile an engine is judged by when none is named (--rules-profile / $NVFP4_RULES_PROFILE)
ENGINE_DEFAULT_PROFILES = {n: b.rules_profile for n, b in selection.BUILTINS.items() if b.rules_profile}


def engine_spec(cli_value: str | None) -> str:
    return selection.option_value("--engine", cli_value, "rules")


def load_rules_engine(spec: str) -> RulesEngine:
    """The :class:`RulesEngine` ``spec`` names. :class:`EngineUnavailable` when the engine cannot run on this
    host (its cases skip), :class:`EngineLoadError` when ``spec`` names nothing usable (a usage error, or a
    skip of the rule cases when a ``module:attr`` implements only other interfaces)."""
    try:
        obj = selection.import_target(selection.target_of(spec, "rules"))
        engine = selection.instantiate(obj, "rules")
    except selection.SelectionError as exc:
        raise EngineLoadError(f"cannot load engine {spec!r}: {exc}") from exc
    if not isinstance(engine, RulesEngine):
        raise EngineLoadError(f"{spec} produced {engine!r}, which is not a conformance.interfaces.rules.RulesEngine")
    return engine


__all__ = ["BUILTIN_ENGINES", "DEFAULT_ENGINE", "ENGINE_DEFAULT_PROFILES", "ENGINE_ENV_VAR", "EngineLoadError",
           "EngineUnavailable", "engine_spec", "load_rules_engine"]
