"""Engine integration harness: run an engine's real NVFP4 layer code against the FlashInfer emulator
(:mod:`reference_impl.flashinfer_emulator`) on any machine, and compare with the checkpoint reference.

Engine-neutral parts: :mod:`.standin` (emulator in place of ``flashinfer``), :mod:`.core` (adapter
interface, scenario), :mod:`.checks`, :mod:`.cases`. One adapter module per engine
(:mod:`.sglang`, :mod:`.vllm`); select it with ``pytest --engine NAME|module:attr``. See docs/engine_harness.md.
"""
from __future__ import annotations

import importlib
import os

ENGINE_ENV_VAR = "NVFP4_HARNESS_ENGINE"
DEFAULT_ENGINE = "sglang"
BUILTIN_ENGINES = {
    "sglang": "conformance.engine_harness.sglang:SGLangLayerCode",
    "vllm": "conformance.engine_harness.vllm:VLLMLayerCode",
}


class EngineLoadError(RuntimeError):
    """The engine adapter named on the command line could not be imported."""


class NotALayerCodeEngine(EngineLoadError):
    """``--engine module:attr`` names something else (e.g. only a :class:`RulesEngine`): the harness skips."""


def load_layer_code_engine(spec: str | None = None):
    """Resolve ``spec`` (a built-in name or ``module:attr``; default ``$NVFP4_HARNESS_ENGINE`` or sglang) to
    a :class:`~conformance.interfaces.layer_code.LayerCodeEngine` instance. Importing the adapter module must
    not import the engine (the adapter's ``skip_reason`` reports a missing engine)."""
    from conformance.interfaces.layer_code import LayerCodeEngine

    spec = spec or os.environ.get(ENGINE_ENV_VAR) or DEFAULT_ENGINE
    target = BUILTIN_ENGINES.get(spec, spec)
    if ":" not in target:
        raise EngineLoadError(f"unknown engine {spec!r}: use one of {sorted(BUILTIN_ENGINES)} or 'module:attr'")
    module_name, attr = target.split(":", 1)
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise EngineLoadError(f"cannot load engine adapter {target!r}: {exc}") from exc
    adapter = obj() if isinstance(obj, type) else obj
    if not isinstance(adapter, LayerCodeEngine):
        raise NotALayerCodeEngine(f"{target} is not a LayerCodeEngine (conformance.interfaces.layer_code): "
                                  f"the engine-harness tests have nothing to run")
    return adapter
