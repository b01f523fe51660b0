"""The engine-neutral part of the harness: the adapter interface an engine implements, the scenario
(build the engine's layer, load the checkpoint through its loaders, post-process, forward, reload,
forward again) and the named checks applied to what the scenario observed.

An engine adapter (``sglang_adapter.py`` is the first) knows how to build that engine's real layer
objects and which of its module-level names must point at the emulator; everything else lives here.
"""
from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from conformance.interfaces.kernel import DenseLayer, MoEExperts
from conformance.engine_harness.standin import StandIn

Mode = Literal["w4a16", "w4a4"]


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


class EngineAdapter(abc.ABC):
    """One engine under the harness. All methods run inside :meth:`stand_in` (the emulator active)."""

    name: str = "engine"

    @abc.abstractmethod
    def skip_reason(self) -> str | None:
        """``None`` when the engine can be exercised here, else why not (e.g. not installed)."""

    @abc.abstractmethod
    def stand_in(self, mode: Mode, kind: Literal["dense", "moe"], modules: dict, ckpt: Any) -> StandIn:
        """A :class:`StandIn` installing ``modules`` (the emulator's module tree, prepared by the harness)
        for ``mode``, plus the engine's own settings (env, backend selection, parallel layout for ``ckpt``)
        and patches pointing the names it bound from ``flashinfer`` at import time at ``modules``' functions."""

    # dense -------------------------------------------------------------------------------------
    @abc.abstractmethod
    def build_dense(self, ckpt: DenseLayer, mode: Mode) -> Any:
        """The engine's real linear layer for ``ckpt``'s shapes (weights created, not loaded)."""

    @abc.abstractmethod
    def load_dense(self, layer: Any, ckpt: DenseLayer) -> None:
        """Feed the checkpoint tensors through the engine's own weight loaders (per fused shard)."""

    @abc.abstractmethod
    def forward_dense(self, layer: Any, x: torch.Tensor) -> torch.Tensor: ...

    # moe ---------------------------------------------------------------------------------------
    def build_moe(self, ckpt: "MoECheckpoint", mode: Mode) -> Any:
        raise NotImplementedError(f"{self.name}: no MoE integration")

    def load_moe(self, layer: Any, ckpt: "MoECheckpoint") -> None:
        raise NotImplementedError(f"{self.name}: no MoE integration")

    def forward_moe(self, layer: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{self.name}: no MoE integration")

    # shared ------------------------------------------------------------------------------------
    @abc.abstractmethod
    def post_load(self, layer: Any) -> None:
        """The engine's post-load processing (``process_weights_after_loading`` or its equivalent)."""

    @abc.abstractmethod
    def graph_captured_params(self, layer: Any) -> dict[str, torch.Tensor]:
        """The tensors a captured CUDA graph reads (prepared weights, scales, alphas): the contract says a
        same-shape reload keeps each of them the same object at the same address (SPEC section 6)."""


@dataclass(frozen=True)
class MoECheckpoint:
    """A MoE layer's checkpoint across all ``num_global_experts`` experts (what every EP rank's loader
    sees), and which slice this rank owns. ``gate/up/down`` are lists per global expert of
    (packed, linear block scale, weight_scale_2, input_scale)."""

    gate: tuple
    up: tuple
    down: tuple
    hidden: int
    intermediate: int
    top_k: int
    ep_rank: int
    ep_size: int

    @property
    def num_global_experts(self) -> int:
        return len(self.gate)

    @property
    def num_local_experts(self) -> int:
        return self.num_global_experts // self.ep_size

    def local_experts(self) -> MoEExperts:
        """This rank's experts in the reference's form (halves ``[gate; up]``, scales ``[E, 2]``)."""
        lo = self.ep_rank * self.num_local_experts
        sel = range(lo, lo + self.num_local_experts)
        g, u, d = ([part[e] for e in sel] for part in (self.gate, self.up, self.down))
        return MoEExperts(
            w13=torch.stack([torch.cat((gi[0], ui[0])) for gi, ui in zip(g, u)]),
            w13_scale=torch.stack([torch.cat((gi[1], ui[1])) for gi, ui in zip(g, u)]),
            w13_scale_2=torch.stack([torch.stack((gi[2], ui[2])) for gi, ui in zip(g, u)]).float(),
            w2=torch.stack([di[0] for di in d]),
            w2_scale=torch.stack([di[1] for di in d]),
            w2_scale_2=torch.stack([di[2] for di in d]).float(),
            num_global_experts=self.num_global_experts,
            ep_rank=self.ep_rank,
            ep_size=self.ep_size,
        )


def run_scenario(
    adapter: EngineAdapter,
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
