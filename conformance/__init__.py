"""NVFP4 W4A16 conformance suite: the public face.

What you bring is one class per interface (select it with the option named; ``module:attr`` or a built-in name):

* :class:`Backend` -- your W4A16 kernel (``--backend``), built from :class:`DenseLayer` / :class:`MoEExperts`
  checkpoints, told the case by :class:`CaseInfo`;
* :class:`RulesEngine` -- your engine's configuration rules (``--engine``);
* :class:`LayerCodeEngine` -- your engine's layer code under the FlashInfer emulator (``--engine``);
* :class:`ServerDialect` -- your server's API (``--server-api``; :class:`OpenAIDialect` is the standard one to
  extend).

Helpers a test, a plugin or a report reader may use are in :mod:`conformance.testing`; the pytest plugin is
:mod:`conformance.plugin` (``pytest -p conformance.plugin`` when installed). Everything under
``conformance._framework`` and the areas' modules is internal and may change without notice.

The names are imported on first use, so ``import conformance`` stays cheap.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

_EXPORTS = {
    "Backend": "conformance.interfaces.kernel",
    "CaseInfo": "conformance.interfaces.kernel",
    "DenseLayer": "conformance.interfaces.kernel",
    "MoEExperts": "conformance.interfaces.kernel",
    "RulesEngine": "conformance.interfaces.rules",
    "LayerCodeEngine": "conformance.interfaces.layer_code",
    "ServerDialect": "conformance.interfaces.server",
    "OpenAIDialect": "conformance.interfaces.server_openai",
    "EngineUnavailable": "conformance.interfaces.errors",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'conformance' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
