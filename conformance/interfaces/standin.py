"""Putting the FlashInfer emulator in the place of the ``flashinfer`` package, and taking it out again.

Two things have to change for an engine to call the emulator:

1. ``sys.modules``: every ``flashinfer`` / ``flashinfer.*`` entry is replaced by the emulator's module tree
   (:func:`reference_impl.flashinfer_emulator.flashinfer_module_tree`), so imports done *at call time*
   (``from flashinfer import prepare_bf16_fp4_weights`` inside a function) get the emulator, and
   submodules the emulator does not provide fail with ``ModuleNotFoundError``.
2. Names an engine module bound *at import time* (``from flashinfer import mm_fp4 as flashinfer_fp4_gemm``)
   are attributes of that module: the engine adapter lists them as :class:`AttrPatch` es.

:class:`StandIn` applies both (plus environment variables, plus the engine's own context managers,
:meth:`StandIn.engine_contexts`) and restores everything on exit, in reverse order, even when the body raises.
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

_MISSING = object()


@dataclass(frozen=True)
class AttrPatch:
    """Set ``target.name = value`` for the duration of the stand-in; ``why`` is shown in reports."""

    target: Any
    name: str
    value: Any
    why: str = ""


class StandIn:
    """Context manager: emulator modules in ``sys.modules``, attribute patches, environment variables, then the
    engine's own context managers (:meth:`engine_contexts`, one ``ExitStack`` this class owns)."""

    def __init__(
        self,
        modules: dict[str, ModuleType],
        patches: list[AttrPatch] = (),
        env: dict[str, str | None] | None = None,
    ):
        self.modules = dict(modules)
        self.patches = list(patches)
        self.env = dict(env or {})
        self._saved_modules: dict[str, ModuleType] = {}
        self._saved_attrs: list[tuple[Any, str, Any]] = []
        self._saved_env: dict[str, str | None] = {}
        self._stack: contextlib.ExitStack | None = None
        self.active = False

    def engine_contexts(self) -> Iterable[contextlib.AbstractContextManager]:
        """The engine's own context managers (its runtime context, CPU kernels for CUDA-only custom ops, ...),
        entered in order once the modules, environment and patches are in place, and exited first, in reverse
        order. Override in an engine's subclass (a generator is fine: its code runs while entering, so an import
        or setup error there undoes everything entered before it). None by default."""
        return ()

    def __enter__(self) -> "StandIn":
        if self.active:
            raise RuntimeError("StandIn is not re-entrant")
        try:
            for key in [k for k in sys.modules if k == "flashinfer" or k.startswith("flashinfer.")]:
                self._saved_modules[key] = sys.modules.pop(key)
            sys.modules.update(self.modules)
            for name, value in self.env.items():
                self._saved_env[name] = os.environ.get(name)
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            for p in self.patches:
                self._saved_attrs.append((p.target, p.name, getattr(p.target, p.name, _MISSING)))
                setattr(p.target, p.name, p.value)
            self._stack = contextlib.ExitStack()
            for context in self.engine_contexts():
                self._stack.enter_context(context)
        except BaseException:
            self._restore()
            raise
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def add_patch(self, patch: AttrPatch) -> None:
        """Apply one more patch while active (restored with the others)."""
        self._saved_attrs.append((patch.target, patch.name, getattr(patch.target, patch.name, _MISSING)))
        setattr(patch.target, patch.name, patch.value)

    def _restore(self) -> None:
        stack, self._stack = self._stack, None
        try:
            if stack is not None:
                stack.close()
        finally:
            self._restore_own()

    def _restore_own(self) -> None:
        for target, name, old in reversed(self._saved_attrs):
            if old is _MISSING:
                try:
                    delattr(target, name)
                except AttributeError:
                    pass
            else:
                setattr(target, name, old)
        self._saved_attrs.clear()
        for name, old in self._saved_env.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
        self._saved_env.clear()
        for key in self.modules:
            if sys.modules.get(key) is self.modules[key]:
                del sys.modules[key]
        sys.modules.update(self._saved_modules)
        self._saved_modules.clear()
        self.active = False


@contextlib.contextmanager
def cpu_kernel(namespace: str, op: str, fn: Any):
    """``fn`` (an engine's own Python body of ``namespace::op``, an op it registers for CUDA only) registered as
    the op's CPU kernel while the context is open; deregistered on exit."""
    import torch

    lib = torch.library.Library(namespace, "IMPL")
    lib.impl(op, fn, "CPU")
    try:
        yield
    finally:
        lib._destroy()


def tensor_cuda_noop(self: Any, *args: Any, **kwargs: Any) -> Any:
    """A stand-in for ``torch.Tensor.cuda`` on a CPU-only run (an :class:`AttrPatch` target): the tensor itself."""
    return self
