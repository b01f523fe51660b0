"""Which implementation is under test: the one way an option names one, over the one table of built-ins
(:data:`BUILTINS`: a row per vendor folder of :mod:`conformance.adapters`; the rows name
``module:attr`` strings, so the framework never imports an adapter until an option selects it).

Options and the interfaces they select (:data:`OPTIONS`): ``--backend`` the kernel (:class:`Backend`),
``--engine`` the configuration rules (:class:`RulesEngine`) and the layer code (:class:`LayerCodeEngine`) at
once, ``--server-api`` the server dialect (:class:`ServerDialect`). Each takes a built-in name or
``module:attr`` (like array-api-tests' ``ARRAY_API_TESTS_MODULE``), from the command line or one environment
variable; older variable names are read as deprecated aliases.
"""
from __future__ import annotations

import importlib
import os
import warnings
from dataclasses import dataclass, field
from collections.abc import Iterable
from typing import Any

from conformance.interfaces.errors import EngineUnavailable
from conformance.interfaces.kernel import Backend


#: interface key -> the class its implementations must be (``module:attr``; imported only when checking)
INTERFACES = {
    "kernel": "conformance.interfaces.kernel:Backend",
    "rules": "conformance.interfaces.rules:RulesEngine",
    "layer_code": "conformance.interfaces.layer_code:LayerCodeEngine",
    "server": "conformance.interfaces.server:ServerDialect",
    "flashinfer_platform": "conformance.interfaces.flashinfer_platform:FlashInferPlatform",
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
    Builtin("flashinfer", {"kernel": _adapter("flashinfer", "kernel", "all_backends"),
                           "flashinfer_platform": _adapter("flashinfer", "platform", "current_platform")}),
    Builtin("sglang", {"rules": _adapter("sglang", "rules", "load"),
                       "layer_code": _adapter("sglang", "layer_code", "SGLangLayerCode"),
                       "server": _adapter("sglang", "server", "SGLangDialect")}),
    Builtin("openai", {"server": "conformance.interfaces.server_openai:OpenAIDialect"}),
    Builtin("vllm", {"rules": _adapter("vllm", "rules", "load"),
                     "layer_code": _adapter("vllm", "layer_code", "VLLMLayerCode"),
                     "server": _adapter("vllm", "server", "VLLMDialect")}, rules_profile="vllm-0.32"),
)}


def register(builtin: Builtin) -> None:
    """Add (or replace) a built-in row, e.g. from a vendor's pytest plugin."""
    unknown = set(builtin.implements) - set(INTERFACES)
    if unknown:
        raise ValueError(f"{builtin.name}: unknown interface(s) {sorted(unknown)}; known: {sorted(INTERFACES)}")
    BUILTINS[builtin.name] = builtin


def names_for(interface: str) -> list[str]:
    """The built-in names implementing ``interface``, in table order."""
    return [b.name for b in BUILTINS.values() if interface in b.implements]


_LABELS = {"kernel": "backend", "rules": "engine", "layer_code": "engine", "server": "server API",
           "flashinfer_platform": "FlashInfer platform"}


@dataclass(frozen=True)
class Option:
    """A selecting option: its flag, its environment variable (and deprecated aliases), the interfaces it
    selects and, per interface, the default when neither is given."""

    flag: str
    env: str
    defaults: dict[str, str]
    aliases: tuple[str, ...] = field(default=())


#: The reference has configuration rules but no layer code of its own: without ``--engine`` the rules
#: under test are the reference's and the layer code is SGLang's (the engine this suite was born from).
OPTIONS: dict[str, Option] = {o.flag: o for o in (
    Option("--backend", "NVFP4_CONFORMANCE_BACKEND", {"kernel": "reference,flashinfer"}),
    Option("--engine", "NVFP4_CONFORMANCE_ENGINE", {"rules": "reference", "layer_code": "sglang"},
           aliases=("NVFP4_HARNESS_ENGINE",)),
    Option("--server-api", "NVFP4_CONFORMANCE_SERVER_API", {"server": "sglang"}),
    # no default of its own: the rules profile follows the engine (its row's rules_profile) unless named
    Option("--rules-profile", "NVFP4_RULES_PROFILE", {}),
)}


class SelectionError(RuntimeError):
    """An option names nothing that can be loaded (unknown name, import error, wrong kind): a usage error. The one
    error type of selection (:class:`NotImplementedHere` refines it into a skip)."""


class NotImplementedHere(SelectionError):
    """The named implementation exists but does not implement this interface (e.g. ``--engine`` naming only a
    RulesEngine, for the layer-code tests): that interface's tests skip with this reason."""


#: 0.2's names of the one error type (``--engine`` / ``--backend`` naming nothing loadable)
EngineLoadError = SelectionError


def option_value(flag: str, cli_value: str | None, interface: str) -> str | None:
    """What ``flag`` selects for ``interface``: the command line, else its environment variable (or a
    deprecated alias, with a DeprecationWarning), else the option's default for that interface (None: none)."""
    opt = OPTIONS[flag]
    if cli_value:
        return cli_value
    if os.environ.get(opt.env):
        return os.environ[opt.env]
    for alias in opt.aliases:
        if os.environ.get(alias):
            warnings.warn(f"${alias} is deprecated: set ${opt.env} (it selects {flag} for every interface)",
                          DeprecationWarning, stacklevel=2)
            return os.environ[alias]
    return opt.defaults.get(interface)


def target_of(name: str, interface: str) -> str:
    """``module:attr`` implementing ``interface`` for ``name`` (a built-in name or already ``module:attr``)."""
    if ":" in name:
        return name
    row = BUILTINS.get(name)
    if row is None:
        raise SelectionError(f"unknown {_LABELS[interface]} {name!r}: use one of {names_for(interface)} or "
                             f"'module:attr'")
    if interface not in row.implements:
        raise NotImplementedHere(f"built-in {name!r} implements {sorted(row.implements)}, not {interface} "
                                 f"(built-ins implementing it: {names_for(interface)})")
    return row.implements[interface]


def import_target(target: str) -> Any:
    """The object ``module:attr`` names. ImportError/AttributeError become :class:`SelectionError`; any
    other exception raised while importing (e.g. an engine saying it is not installed) propagates."""
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SelectionError(f"cannot import {module_name!r} ({target}): {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise SelectionError(f"module {module_name!r} has no attribute {attr!r}") from exc


def interface_class(interface: str) -> type:
    return import_target(INTERFACES[interface])


def instantiate(obj: Any, interface: str) -> Any:
    """``obj`` as an instance: a class of the interface is built, another zero-argument callable is called,
    an instance is used as is (the result is not checked here: callers check its kind)."""
    cls = interface_class(interface)
    if isinstance(obj, type):
        return obj()
    if not isinstance(obj, cls) and callable(obj):
        return obj()
    return obj


def flashinfer_platform(installed: bool = False) -> Any:
    """Where FlashInfer runs for the b200 tier (:class:`conformance.interfaces.flashinfer_platform.FlashInferPlatform`):
    the emulator under ``--flashinfer-emulated``, else (or when ``installed``) the installed library."""
    return import_target(target_of("flashinfer", "flashinfer_platform"))(installed=installed)


def rules_profile_of(name: str) -> str | None:
    """The rules profile a built-in's rules are judged by unless told (None: the suite's default)."""
    row = BUILTINS.get(name)
    return row.rules_profile if row else None


# ------------------------------------------------------------------------------------------- --backend
BACKEND_ENV_VAR = OPTIONS["--backend"].env
DEFAULT_BACKEND = OPTIONS["--backend"].defaults["kernel"]


def builtin_backends() -> dict[str, str]:
    """Built-in backend name -> ``module:attr`` (a view of the table's ``kernel`` column)."""
    return {n: target_of(n, "kernel") for n in names_for("kernel")}


BackendLoadError = SelectionError


def backend_spec_from_env(cli_value: str | None) -> str:
    return option_value("--backend", cli_value, "kernel")


def load_backends(spec: str) -> list[Backend]:
    """Resolve ``spec`` (built-in names or ``module:attr``, comma-separated) to backend instances.
    ``attr`` may be a :class:`Backend` subclass, an instance, or a zero-argument callable returning an
    instance or a list of instances (one per kernel variant, each its own parametrization)."""
    parts = [p.strip() for p in spec.split(",")]
    if not all(parts):
        raise BackendLoadError(f"empty backend name in {spec!r}")
    backends = [b for part in parts for b in _load_one(part)]
    names = [b.name for b in backends]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise BackendLoadError(f"{spec!r} names backend(s) {duplicates} more than once (test ids must be unique)")
    return backends


def _load_one(spec: str) -> list[Backend]:
    try:
        target = target_of(spec, "kernel")
        obj = import_target(target)
    except SelectionError as exc:
        raise BackendLoadError(str(exc)) from exc
    if isinstance(obj, type) and not issubclass(obj, Backend):
        raise BackendLoadError(f"{target} is {obj!r}, which is not a conformance.interfaces.kernel.Backend")
    obj = instantiate(obj, "kernel")
    backends = [obj] if isinstance(obj, Backend) else list(obj) if isinstance(obj, Iterable) else [obj]
    for b in backends:
        if not isinstance(b, Backend):
            raise BackendLoadError(f"{target} produced {b!r}, which is not a conformance.interfaces.kernel.Backend")
    if not backends:
        raise BackendLoadError(f"{target} produced no backend")
    return backends


__all__ = ["BACKEND_ENV_VAR", "BUILTINS", "DEFAULT_BACKEND", "INTERFACES", "OPTIONS", "BackendLoadError", "Builtin",
           "EngineLoadError", "EngineUnavailable", "NotImplementedHere", "Option", "SelectionError",
           "backend_spec_from_env", "builtin_backends", "flashinfer_platform", "import_target", "instantiate", "load_backends", "names_for",
           "option_value", "register", "rules_profile_of", "target_of"]
