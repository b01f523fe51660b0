"""Where FlashInfer runs, as the suite asks it: the installed library on a B200, or the emulator standing in for it
(``--flashinfer-emulated``). The FlashInfer adapter implements it (:mod:`conformance.adapters.flashinfer.platform`);
the areas get one through the selection table (``flashinfer_platform`` of the ``flashinfer`` built-in), so they
never import the adapter."""
from __future__ import annotations

import abc
from types import ModuleType
from typing import Any

import torch

from conformance.interfaces.hardware import Gpu

__all__ = ["FlashInferPlatform"]


class FlashInferPlatform(abc.ABC):
    """What the FlashInfer backends and the engine harness need to know about where FlashInfer runs."""

    #: ``True`` for the emulator standing in (reports mark such runs, never counting them as B200 results).
    emulated: bool = False

    @abc.abstractmethod
    def load(self) -> tuple[Any, str | None]:
        """``(flashinfer API module, None)``, or ``(None, why not)`` (missing, broken, too old)."""

    @abc.abstractmethod
    def describe(self, module: Any) -> str:
        """Version text for reports, e.g. ``flashinfer 0.7.4``."""

    @abc.abstractmethod
    def gpu(self, device: torch.device) -> Gpu | str:
        """The GPU a case on ``device`` runs on (its capability decides), or why there is none."""

    @abc.abstractmethod
    def cudnn(self) -> tuple[str | None, int | None, int, str | None]:
        """``(frontend version, backend version, FlashInfer's minimum backend version, why unavailable)``."""

    @abc.abstractmethod
    def cute_dsl_problem(self, capability: tuple[int, int] | None) -> str | None:
        """Why the CuTe DSL cannot run here (``capability``: also check its arch support, MoE kernels)."""

    def cute_dsl_gemm_shape_problem(self, m: int, n: int, k: int, capability: tuple[int, int]) -> str | None:
        """Why the ``cute-dsl`` dense GEMM has no kernel for ``M x N x K`` here (``None``: it has one, or the
        platform cannot tell). Only the installed FlashInfer can answer: it asks its own kernel's
        ``can_implement`` for every tactic, as its tactic chooser does."""
        return None

    @abc.abstractmethod
    def moe_wrapper(self) -> tuple[type, Any]:
        """``(CuteDslMoEWrapper, ActivationType)``; import errors propagate."""

    @abc.abstractmethod
    def module_tree(self) -> dict[str, ModuleType]:
        """``flashinfer*`` modules for the engine harness's stand-in (``sys.modules`` entries)."""

    @abc.abstractmethod
    def gemm_skip_reason(self, gemm_backend: str, device: torch.device | str) -> str | None:
        """Why FlashInfer's ``mm_bf16_fp4`` backend ``gemm_backend`` cannot run on ``device`` here (FlashInfer's own
        capability gate and the backend's preconditions), or None."""

    @abc.abstractmethod
    def moe_skip_reason(self, device: torch.device | str) -> str | None:
        """Why the CuTe DSL MoE cannot run on ``device`` here, or None."""

