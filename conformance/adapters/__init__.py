"""The built-in implementations, one folder per vendor: what the suite ships for each vendor interface
(:mod:`conformance.interfaces`). Each is one row of :data:`BUILTINS`, the selection table that ``--backend``,
``--engine`` and ``--server-api`` read: a name and, per interface it implements, the ``module:attr`` of the
object that implements it (a class, an instance or a zero-argument factory). Adding an engine is its folder here
plus one row (or :func:`register` from a pytest plugin, for one kept elsewhere); docs/contributing.md.

* :mod:`.reference`: the reference kernel (``--backend reference``) and the reference's configuration rules;
* :mod:`.flashinfer`: FlashInfer's W4A16 GEMM and CuTe DSL MoE (``--backend flashinfer``, the ``b200`` tier);
* :mod:`.sglang`: SGLang 0.5.23's rules, layer code and server API (``--engine sglang``, ``--server-api sglang``);
* :mod:`.vllm`: vLLM 0.32's rules, layer code and server API (``--engine vllm``, ``--server-api vllm``).

Importing an adapter module never imports its engine: an engine that is not installed is a skip reason.
``openai`` (a standard API, not a vendor) lives in ``conformance/server/openai.py``. This module depends on the
standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass

#: interface key -> the class its implementations must be (``module:attr``; imported only when checking)
INTERFACES = {
    "kernel": "conformance.interfaces.kernel:Backend",
    "rules": "conformance.interfaces.rules:RulesEngine",
    "layer_code": "conformance.interfaces.layer_code:LayerCodeEngine",
    "server": "conformance.interfaces.server:ServerDialect",
}


@dataclass(frozen=True)
class Builtin:
    """One built-in implementation: ``implements`` maps interface keys (:data:`INTERFACES`) to ``module:attr``;
    ``rules_profile``: the rules profile its rules are judged by unless ``--rules-profile`` says otherwise."""

    name: str
    implements: dict[str, str]
    rules_profile: str | None = None


def _adapter(vendor: str, module: str, attr: str) -> str:
    return f"conformance.adapters.{vendor}.{module}:{attr}"


BUILTINS: dict[str, Builtin] = {b.name: b for b in (
    Builtin("reference", {"kernel": _adapter("reference", "kernel", "ReferenceBackend"),
                          "rules": _adapter("reference", "rules", "ReferenceRules")}),
    Builtin("flashinfer", {"kernel": _adapter("flashinfer", "kernel", "all_backends")}),
    Builtin("sglang", {"rules": _adapter("sglang", "rules", "load"),
                       "layer_code": _adapter("sglang", "layer_code", "SGLangLayerCode"),
                       "server": _adapter("sglang", "server", "SGLangDialect")}),
    Builtin("openai", {"server": "conformance.server.openai:OpenAIDialect"}),
    Builtin("vllm", {"rules": _adapter("vllm", "rules", "load"),
                     "layer_code": _adapter("vllm", "layer_code", "VLLMLayerCode"),
                     "server": _adapter("vllm", "server", "VLLMDialect")}, rules_profile="vllm-0.32"),
)}


class EngineUnavailable(RuntimeError):
    """The engine exists but cannot run on this host (e.g. not installed): its cases skip with this reason
    (and fail when the engine was asked for by name). Each engine's own "not importable" error derives from it."""


def register(builtin: Builtin) -> None:
    """Add (or replace) a built-in row, e.g. from a vendor's pytest plugin."""
    unknown = set(builtin.implements) - set(INTERFACES)
    if unknown:
        raise ValueError(f"{builtin.name}: unknown interface(s) {sorted(unknown)}; known: {sorted(INTERFACES)}")
    BUILTINS[builtin.name] = builtin


def names_for(interface: str) -> list[str]:
    """The built-in names implementing ``interface``, in table order."""
    return [b.name for b in BUILTINS.values() if interface in b.implements]


__all__ = ["BUILTINS", "Builtin", "EngineUnavailable", "INTERFACES", "names_for", "register"]
