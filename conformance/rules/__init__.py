"""Rules-engine selection: ``--engine NAME`` for a built-in one, ``--engine module:attr`` for another.

Built-ins: ``reference`` (reference_impl's rules), ``sglang`` (SGLang 0.5.23's own code on CPU) and ``vllm``
(vLLM 0.32's own kernel selection on CPU).
``attr`` may be a :class:`~conformance.interfaces.rules.RulesEngine` subclass, an instance, or a zero-argument factory.
"""
from __future__ import annotations

import importlib
import os

from conformance.interfaces.rules import RulesEngine
from conformance.rules._sglang_import import SGLangUnavailable
from conformance.rules._vllm_import import VLLMUnavailable

ENGINE_ENV_VAR = "NVFP4_CONFORMANCE_ENGINE"
DEFAULT_ENGINE = "reference"
BUILTIN_ENGINES = {
    "reference": "conformance.rules.reference:ReferenceRules",
    "sglang": "conformance.rules.sglang:load",
    "vllm": "conformance.rules.vllm:load",
}
#: the rules profile an engine is judged by when none is named (--rules-profile / $NVFP4_RULES_PROFILE)
ENGINE_DEFAULT_PROFILES = {"vllm": "vllm-0.32"}


class EngineLoadError(RuntimeError):
    """The engine named on the command line could not be found or built (a usage error)."""


class EngineUnavailable(RuntimeError):
    """The engine exists but cannot run on this host (e.g. SGLang not installed): its cases skip."""


def engine_spec(cli_value: str | None) -> str:
    return cli_value or os.environ.get(ENGINE_ENV_VAR) or DEFAULT_ENGINE


def load_rules_engine(spec: str) -> RulesEngine:
    target = BUILTIN_ENGINES.get(spec, spec)
    if ":" not in target:
        raise EngineLoadError(f"unknown engine {spec!r}: use one of {sorted(BUILTIN_ENGINES)} or 'module:attr'")
    module_name, attr = target.split(":", 1)
    try:
        module = importlib.import_module(module_name)
        obj = getattr(module, attr)
    except (SGLangUnavailable, VLLMUnavailable) as exc:
        raise EngineUnavailable(str(exc)) from exc
    except (ImportError, AttributeError) as exc:
        raise EngineLoadError(f"cannot load engine {target!r}: {exc}") from exc
    try:
        engine = obj() if (isinstance(obj, type) or (callable(obj) and not isinstance(obj, RulesEngine))) else obj
    except (SGLangUnavailable, VLLMUnavailable) as exc:
        raise EngineUnavailable(str(exc)) from exc
    if not isinstance(engine, RulesEngine):
        raise EngineLoadError(f"{target} produced {engine!r}, which is not a conformance.interfaces.rules.RulesEngine")
    return engine
