"""The built-in implementations, one folder per vendor: what the suite ships for each vendor interface
(:mod:`conformance.interfaces`). Each is one row of the selection table
(:data:`conformance._framework.selection.BUILTINS`) that ``--backend``, ``--engine`` and ``--server-api`` read: a name and, per interface it implements, the ``module:attr`` of the
object that implements it (a class, an instance or a zero-argument factory). Adding an engine is its folder here
plus one row (or :func:`conformance.testing.register` from a pytest plugin, for one kept elsewhere); docs/contributing.md.

* :mod:`.reference`: the reference kernel (``--backend reference``) and the reference's configuration rules;
* :mod:`.flashinfer`: FlashInfer's W4A16 GEMM and CuTe DSL MoE (``--backend flashinfer``, the ``b200`` tier);
* :mod:`.sglang`: SGLang 0.5.23's rules, layer code and server API (``--engine sglang``, ``--server-api sglang``);
* :mod:`.vllm`: vLLM 0.32's rules, layer code and server API (``--engine vllm``, ``--server-api vllm``).

Importing an adapter module never imports its engine: an engine that is not installed is a skip reason.
``openai`` (a standard API, not a vendor) is a built-in of the server interface itself
(``conformance/interfaces/server_openai.py``). Adapters import only :mod:`conformance.interfaces` and :mod:`reference_impl` (import-linter contracts in
pyproject.toml); the names below are re-exported from the framework for code written against 0.2.
"""
from __future__ import annotations

from conformance._framework.selection import BUILTINS, INTERFACES, Builtin, names_for, register
from conformance.interfaces.errors import EngineUnavailable

__all__ = ["BUILTINS", "Builtin", "EngineUnavailable", "INTERFACES", "names_for", "register"]
