"""Engine integration harness: run an engine's real NVFP4 layer code against the FlashInfer emulator
(:mod:`reference_impl.flashinfer_emulator`) on any machine, and compare with the checkpoint reference.

Engine-neutral parts: :mod:`.standin` (emulator in place of ``flashinfer``), :mod:`.core` (scenario),
:mod:`.checks`, :mod:`.cases`, :mod:`.a2a_prefill`. Each engine's adapter lives in its vendor folder
(``conformance/adapters/sglang/layer_code.py``, ``conformance/adapters/vllm/layer_code.py``), one row of the
selection table (``conformance/_framework/selection.py``); select it with ``pytest --engine NAME|module:attr``.
See docs/engine_harness.md.
"""
from __future__ import annotations

from conformance._framework import selection
from conformance._framework.selection import EngineLoadError

ENGINE_ENV_VAR = selection.OPTIONS["--engine"].env
DEFAULT_ENGINE = selection.OPTIONS["--engine"].defaults["layer_code"]
#: built-in name -> ``module:attr`` (a view of the selection table)
BUILTIN_ENGINES = {n: selection.target_of(n, "layer_code") for n in selection.names_for("layer_code")}


class NotALayerCodeEngine(EngineLoadError):
    """``--engine`` names something else (e.g. only a :class:`RulesEngine`): the harness skips."""


def load_layer_code_engine(spec: str | None = None):
    """Resolve ``spec`` (a built-in name or ``module:attr``; default ``$NVFP4_CONFORMANCE_ENGINE`` or sglang) to
    a :class:`~conformance.interfaces.layer_code.LayerCodeEngine` instance. Importing the adapter module must
    not import the engine (the adapter's ``skip_reason`` reports a missing engine)."""
    from conformance.interfaces.layer_code import LayerCodeEngine

    spec = selection.option_value("--engine", spec, "layer_code")
    try:
        target = selection.target_of(spec, "layer_code")
    except selection.NotImplementedHere as exc:
        raise NotALayerCodeEngine(f"{spec} is not a LayerCodeEngine (conformance.interfaces.layer_code): {exc}; "
                                  f"the engine-harness tests have nothing to run") from exc
    except selection.SelectionError as exc:
        raise EngineLoadError(str(exc)) from exc
    try:
        obj = selection.import_target(target)
    except selection.SelectionError as exc:
        raise EngineLoadError(f"cannot load engine adapter {target!r}: {exc}") from exc
    adapter = selection.instantiate(obj, "layer_code")
    if not isinstance(adapter, LayerCodeEngine):
        raise NotALayerCodeEngine(f"{target} is not a LayerCodeEngine (conformance.interfaces.layer_code): "
                                  f"the engine-harness tests have nothing to run")
    return adapter


__all__ = ["BUILTIN_ENGINES", "DEFAULT_ENGINE", "ENGINE_ENV_VAR", "EngineLoadError", "NotALayerCodeEngine",
           "load_layer_code_engine"]
