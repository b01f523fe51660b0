"""Which implementation is under test: the one way an option names one, over the one table of built-ins
(:data:`conformance.adapters.BUILTINS`: a row per vendor folder).

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
from typing import Any

from conformance.adapters import (  # noqa: F401 - the table, re-exported for the framework
    BUILTINS,
    INTERFACES,
    Builtin,
    EngineUnavailable,
    names_for,
    register,
)

_LABELS = {"kernel": "backend", "rules": "engine", "layer_code": "engine", "server": "server API"}


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
)}


class SelectionError(RuntimeError):
    """An option names nothing that can be loaded (unknown name, import error, wrong kind): a usage error."""


class NotImplementedHere(SelectionError):
    """The named implementation exists but does not implement this interface (e.g. ``--engine`` naming only a
    RulesEngine, for the layer-code tests): that interface's tests skip with this reason."""


class EngineLoadError(SelectionError):
    """``--engine`` names nothing that can be loaded as the interface asked for (a usage error)."""


def option_value(flag: str, cli_value: str | None, interface: str) -> str:
    """What ``flag`` selects for ``interface``: the command line, else its environment variable (or a
    deprecated alias, with a DeprecationWarning), else the option's default for that interface."""
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
    return opt.defaults[interface]


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


def rules_profile_of(name: str) -> str | None:
    """The rules profile a built-in's rules are judged by unless told (None: the suite's default)."""
    row = BUILTINS.get(name)
    return row.rules_profile if row else None


__all__ = ["BUILTINS", "Builtin", "EngineLoadError", "EngineUnavailable", "INTERFACES", "NotImplementedHere", "OPTIONS", "Option", "SelectionError",
           "import_target", "instantiate", "names_for", "option_value", "register", "rules_profile_of",
           "target_of"]
