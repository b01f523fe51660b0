"""A pure-PyTorch emulation of FlashInfer 0.7.4's NVFP4 public API, for running an engine's integration
code on any machine (CPU included).

Same names and signatures as ``flashinfer``: :func:`prepare_bf16_fp4_weights`, :func:`mm_bf16_fp4` (W4A16
dense, per backend tag), :class:`CuteDslMoEWrapper` (W4A16 fused MoE), :func:`convert_sf_to_mma_layout`,
:func:`block_scale_interleave`, and the W4A4 path :func:`fp4_quantize` / :func:`nvfp4_quantize` /
:func:`mm_fp4`. Arguments are checked as FlashInfer checks them (same exception types, same order, messages
alike); results are the suite's reference (:mod:`reference_impl.dense`, :mod:`reference_impl.moe`,
:func:`reference_impl.format.nvfp4.quantize_kernel`). The emulated GPU is SM100 unless
``FLASHINFER_EMULATOR_CC`` or :func:`emulated_capability` says otherwise.

:func:`flashinfer_module_tree` returns module objects named like FlashInfer's (``flashinfer``,
``flashinfer.cute_dsl.utils``, ...) for a harness to place in ``sys.modules``.
"""
from __future__ import annotations

import types

from reference_impl.flashinfer_emulator._device import BackendSupportedError, current_capability, emulated_capability
from reference_impl.flashinfer_emulator.fused_moe import ActivationType, CuteDslMoEWrapper
from reference_impl.flashinfer_emulator.gemm import BF16_FP4_BACKENDS, mm_bf16_fp4, prepare_bf16_fp4_weights
from reference_impl.flashinfer_emulator.layouts import (
    block_scale_interleave,
    convert_sf_from_mma_layout,
    convert_sf_to_mma_layout,
    get_mma_sf_shape,
)
from reference_impl.flashinfer_emulator.w4a4 import SfLayout, fp4_quantize, mm_fp4, nvfp4_quantize

#: The FlashInfer release whose API this package emulates.
EMULATED_FLASHINFER_VERSION = "0.7.4"
__version__ = EMULATED_FLASHINFER_VERSION

__all__ = [
    "ActivationType",
    "BF16_FP4_BACKENDS",
    "BackendSupportedError",
    "CuteDslMoEWrapper",
    "EMULATED_FLASHINFER_VERSION",
    "SfLayout",
    "block_scale_interleave",
    "convert_sf_from_mma_layout",
    "convert_sf_to_mma_layout",
    "current_capability",
    "emulated_capability",
    "flashinfer_module_tree",
    "fp4_quantize",
    "get_mma_sf_shape",
    "mm_bf16_fp4",
    "mm_fp4",
    "nvfp4_quantize",
    "prepare_bf16_fp4_weights",
]

# Where FlashInfer 0.7.4 defines each name (module -> names); the top-level package re-exports them all.
_LAYOUT = {
    "flashinfer": (
        "prepare_bf16_fp4_weights", "mm_bf16_fp4", "mm_fp4", "fp4_quantize", "nvfp4_quantize", "SfLayout",
        "CuteDslMoEWrapper", "ActivationType", "block_scale_interleave",
    ),
    "flashinfer.gemm": ("prepare_bf16_fp4_weights", "mm_bf16_fp4", "mm_fp4"),
    "flashinfer.quantization": ("fp4_quantize", "nvfp4_quantize", "block_scale_interleave", "SfLayout"),
    "flashinfer.quantization.fp4_quantization": ("fp4_quantize", "nvfp4_quantize", "block_scale_interleave"),
    "flashinfer.fused_moe": ("CuteDslMoEWrapper",),
    "flashinfer.cute_dsl": (),
    "flashinfer.cute_dsl.utils": ("convert_sf_to_mma_layout", "convert_sf_from_mma_layout", "get_mma_sf_shape"),
    "flashinfer.utils": ("BackendSupportedError",),
    "flashinfer.tllm_enums": ("ActivationType", "SfLayout"),
}


def flashinfer_module_tree() -> dict[str, types.ModuleType]:
    """Fresh module objects named like FlashInfer's, holding the emulated names. Names the emulator does
    not model are absent, so ``from flashinfer import X`` fails with ``ImportError`` as it would on a
    FlashInfer build without ``X`` (engines guard optional features that way)."""
    g = globals()
    modules: dict[str, types.ModuleType] = {}
    for name, attrs in _LAYOUT.items():
        mod = types.ModuleType(name, f"flashinfer_emulator stand-in for {name} (FlashInfer {__version__})")
        mod.__path__ = []  # a package, so submodule imports resolve through sys.modules
        for attr in attrs:
            setattr(mod, attr, g[attr])
        modules[name] = mod
    modules["flashinfer"].__version__ = __version__
    for name, mod in modules.items():  # parent.child attributes, as the import system would set them
        parent, _, child = name.rpartition(".")
        if parent in modules:
            setattr(modules[parent], child, mod)
    return modules
