"""The engine-neutral part of the harness: the scenario (build the engine's layer, load the checkpoint through
its loaders, post-process, forward, reload, forward again) and what it observed, for the named checks.

The interface an engine implements is :class:`conformance.interfaces.layer_code.LayerCodeEngine` (SGLang's,
:mod:`conformance.adapters.sglang.layer_code`, is the first; its value types ``MoECheckpoint`` and ``Mode`` live
there too and are re-exported here); it knows how to build that engine's real layer objects and which of its module-level names
must point at the emulator; everything else lives here.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from conformance.interfaces.kernel import DenseLayer
from conformance.interfaces.layer_code import LayerCodeEngine, MoECheckpoint, Mode



@dataclass(frozen=True)
class ParamIdentity:
    """What CUDA graphs capture about a parameter: the object and its storage address, shape, dtype."""

    obj_id: int
    data_ptr: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def identities(params: dict[str, torch.Tensor]) -> dict[str, ParamIdentity]:
    return {
        name: ParamIdentity(id(t), t.data_ptr(), tuple(t.shape), t.dtype) for name, t in params.items() if t is not None
    }


@dataclass
class EngineRun:
    """What one scenario observed. ``y`` after the first post-load processing, ``y_reload`` after the
    reload (both on the CPU); ``before`` / ``after`` the identities of the parameters the contract says must
    survive a same-shape reload; ``calls`` the emulator entry points the engine called, in order (empty when
    the engine ran against the real FlashInfer)."""

    kind: Literal["dense", "moe"]
    mode: Mode
    y: torch.Tensor
    y_reload: torch.Tensor
    before: dict[str, ParamIdentity]
    after: dict[str, ParamIdentity]
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


def run_scenario(
    adapter: LayerCodeEngine,
    kind: Literal["dense", "moe"],
    mode: Mode,
    ckpt: DenseLayer | MoECheckpoint,
    forward_args: tuple,
    *,
    modules: dict | None = None,
    device: torch.device | str = "cpu",
) -> EngineRun:
    """Build, load, post-process, forward; then reload the same checkpoint, post-process again and forward
    again. Exceptions from the engine or the emulator propagate (an engine that crashes fails).

    ``modules`` is the ``flashinfer*`` module tree the engine's layer code calls (default: the emulator's,
    recording every call); the real FlashInfer's tree makes it call the real kernels. Everything runs under
    ``torch.device(device)``, as an engine's model loader builds its layers: parameters are created there, the
    checkpoint tensors (on the CPU, as read from disk) go through the engine's weight loaders, the forward
    arguments are moved there. Outputs come back on the CPU."""
    calls: list[tuple[str, dict[str, Any]]] = []
    modules = recording_module_tree(calls) if modules is None else modules
    build, load, forward = (
        (adapter.build_dense, adapter.load_dense, adapter.forward_dense)
        if kind == "dense"
        else (adapter.build_moe, adapter.load_moe, adapter.forward_moe)
    )
    device = torch.device(device)
    forward_args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in forward_args)
    placement = contextlib.nullcontext() if device.type == "cpu" else device  # CPU: torch's default already
    with placement, adapter.stand_in(mode, kind, modules, ckpt):
        layer = build(ckpt, mode)
        load(layer, ckpt)
        adapter.post_load(layer)
        with torch.no_grad():
            y = forward(layer, *forward_args).detach().to("cpu", copy=True)
        # After the first forward: engines create some graph-captured state lazily (SGLang's CuTe DSL
        # wrapper and its alphas), and a graph is captured after warm-up forwards.
        before = identities(adapter.graph_captured_params(layer))
        load(layer, ckpt)  # a reload: same checkpoint, same shapes
        adapter.post_load(layer)
        with torch.no_grad():
            y_reload = forward(layer, *forward_args).detach().to("cpu", copy=True)
        after = identities(adapter.graph_captured_params(layer))
    return EngineRun(kind, mode, y, y_reload, before, after, calls)


def _describe(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return f"{v.dtype} {tuple(v.shape)}"
    return v if isinstance(v, (int, float, str, bool, type(None), torch.dtype)) else type(v).__name__


def recording_module_tree(calls: list) -> dict:
    """The emulator's module tree with every function wrapped to append ``(name, {arg: description})`` to
    ``calls``: which FlashInfer entry points the engine used, with which shapes and dtypes."""
    import functools

    from reference_impl.flashinfer_emulator import flashinfer_module_tree

    modules = flashinfer_module_tree()
    wrapped: dict[int, Any] = {}
    for mod in modules.values():
        for name, fn in list(vars(mod).items()):
            if name.startswith("_") or not callable(fn) or isinstance(fn, type) or isinstance(fn, type(mod)):
                continue
            if id(fn) not in wrapped:

                @functools.wraps(fn)
                def record(*args, _fn=fn, _name=name, **kwargs):
                    described = {f"arg{i}": _describe(a) for i, a in enumerate(args)}
                    described.update({k: _describe(v) for k, v in kwargs.items()})
                    calls.append((_name, described))
                    return _fn(*args, **kwargs)

                wrapped[id(fn)] = record
            setattr(mod, name, wrapped[id(fn)])
    return modules


def __getattr__(name: str):
    # 0.1's layer-code interface; deprecated since 0.2.0, goes in 0.3 (CHANGELOG.md)
    if name == "EngineAdapter":
        import warnings

        warnings.warn("conformance.engine_harness.core.EngineAdapter is deprecated since 0.2.0 and goes in 0.3: "
                      "subclass conformance.interfaces.layer_code.LayerCodeEngine", DeprecationWarning, stacklevel=2)
        return LayerCodeEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
