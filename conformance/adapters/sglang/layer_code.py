"""SGLang 0.5.23 under the engine harness: ``ModelOptFp4LinearMethod`` (``quant_mode`` ``w4a16`` and
``w4a4``) in SGLang's real ``ColumnParallelLinear`` / ``QKVParallelLinear``, and
``ModelOptNvFp4FusedMoEMethod`` with the ``flashinfer_cutedsl`` runner in SGLang's real ``FusedMoE``.

This is the one engine-specific module of the harness; a vendor copies it for their engine. It knows:

* how SGLang selects the paths: ``SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16`` and the FP4 GEMM / MoE runner
  backends (published through SGLang's runtime context, as its server does);
* which names SGLang bound from ``flashinfer`` at import time (:meth:`SGLangLayerCode._import_time_patches`);
* what a CPU host lacks: a CPU kernel for the ``sglang::fp4_gemm`` custom op (SGLang registers it for CUDA
  only), and, on the W4A4 path, a Blackwell platform and ``Tensor.cuda()`` in its inline scale swizzle;
* how SGLang's model loaders call the weight loaders (shard ids ``q/k/v``; ``w1/w2/w3`` with expert ids).
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import torch

from conformance.interfaces.kernel import DenseLayer
from conformance.interfaces.layer_code import (QKV_HEAD, LayerCodeEngine, MoECheckpoint, Mode, load_dense_shards,
                                               qkv_heads)
from conformance.interfaces.standin import AttrPatch, StandIn, cpu_kernel, tensor_cuda_noop

W4A16_ENV = "SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16"
TESTED_VERSION = "0.5.23"
_QKV_HEAD = QKV_HEAD  # fused-QKV cases use 32-wide heads: shard rows = heads * 32


class SGLangStandIn(StandIn):
    """The emulator stand-in plus SGLang's runtime context and a CPU kernel for ``sglang::fp4_gemm``."""

    def __init__(self, *args, publish_fields: dict, world_rank: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.publish_fields = publish_fields
        self.world_rank = world_rank

    def engine_contexts(self):
        yield _published_context(self.publish_fields, self.world_rank)
        yield _cpu_fp4_gemm_kernel()


@contextlib.contextmanager
def _published_context(fields: dict, world_rank: int):
    """SGLang's process-wide runtime context, as its test utilities publish it (rank 0 of a world of one),
    reset afterwards. ``world_rank`` selects which rank of a multi-rank launch this process plays
    (expert-parallel slice cases), without building process groups."""
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    ranks = SpawnRanks(world_rank=world_rank)
    reset_context()
    publish(ServerArgs(model_path="dummy", **fields), role="test", ranks=ranks)
    try:
        # What SGLang's scheduler runs after publish: seed the FP4 GEMM and MoE backend flags.
        from sglang.srt.layers.moe.utils import initialize_moe_config
        from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config

        initialize_fp4_gemm_config()
        initialize_moe_config()
        # No process groups on a one-process CPU run: group metadata only, as SGLang's own tests state it.
        parallel = get_parallel()
        parallel.override_permanently(**{
            f"{name}_group": SimpleNamespace(rank_in_group=getattr(parallel, f"{name}_rank"), world_size=getattr(parallel, f"{name}_size"))
            for name in ("tp", "attn_tp")
        })
        yield
    finally:
        reset_context()


@contextlib.contextmanager
def _cpu_fp4_gemm_kernel():
    """Register SGLang's own ``fp4_gemm`` Python function as the CPU kernel of ``sglang::fp4_gemm`` (the
    op is registered for the CUDA dispatch key only); deregistered on exit."""
    from sglang.srt.layers.quantization import modelopt_quant as mq

    wrapper = mq.fp4_gemm  # eager registration: a direct-call wrapper around SGLang's Python function
    op_func = getattr(wrapper, "__wrapped__", None) or getattr(wrapper, "op_func", None)
    if op_func is None:
        raise RuntimeError("cannot find SGLang's fp4_gemm Python function to register as the CPU kernel")
    if not hasattr(torch.ops.sglang, "fp4_gemm"):
        wrapper.real_impl  # lazily registered variant: register now
    with cpu_kernel("sglang", "fp4_gemm", op_func):
        yield


class _BlackwellPlatform:
    """SGLang's platform context, reporting an SM100 GPU (the emulator's) and delegating the rest."""

    def __init__(self, real: Any):
        self._real = real

    is_blackwell = True
    is_sm100 = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class SGLangLayerCode(LayerCodeEngine):
    name = "sglang"
    #: Findings of this harness on SGLang 0.5.23, by case id. The tests require these cases to keep
    #: failing (strict), so a fixed SGLang is noticed and the entry removed.
    known_deviations = {
        "moe-w4a16-gate-up-scales-differ": (
            "flashinfer_cutedsl.resolve_cutedsl_standard_scales takes w13_weight_scale_2[:, 0] (the gate "
            "scale) as the GEMM1 alpha of both halves; with differing gate/up weight_scale_2 the up half is "
            "off by up/gate (the TRT-LLM path rescales block scales, the CuTe DSL path does not)"
        ),
    }

    def skip_reason(self) -> str | None:
        try:
            # The suite's CPU import helper (a torchvision placeholder: PyPI torchvision needs CUDA torch).
            from conformance.adapters.sglang._import import import_sglang_module

            import_sglang_module("sglang.srt.layers.quantization.modelopt_quant")
            import_sglang_module("sglang.srt.layers.moe.fused_moe_triton.layer")
            import_sglang_module("sglang.srt.layers.linear")
        except Exception as exc:  # an engine that does not import is not runnable here
            return f"SGLang is not importable ({type(exc).__name__}: {exc}); see ci/requirements-sglang.txt"
        return None  # other versions still run: the adapter was written for TESTED_VERSION

    def version(self) -> str:
        import sglang

        return getattr(sglang, "__version__", "unknown")

    # ----------------------------------------------------------------------------------- stand-in
    def _import_time_patches(self, mode: Mode, kind: str, fi: Any) -> list[AttrPatch]:
        from sglang.srt.layers.quantization import fp4_utils
        from sglang.srt.layers.quantization import modelopt_quant as mq

        patches = [
            AttrPatch(fp4_utils, "FP4_GEMM_RUNNER_BACKEND", fp4_utils.Fp4GemmRunnerBackend.FLASHINFER_CUTEDSL,
                      "FP4 GEMM backend flashinfer_cutedsl (what --fp4-gemm-backend sets)"),
            AttrPatch(mq, "flashinfer_fp4_gemm", fi.mm_fp4, "bound at import: from flashinfer import mm_fp4"),
            AttrPatch(mq, "enable_flashinfer_fp4_gemm", True, "set at import when flashinfer imports"),
        ]
        if hasattr(fp4_utils, "_flashinfer_fp4_quantize_impl"):
            # SGLang's own wrapper around flashinfer.fp4_quantize, minus its CUDA-only custom-op registration.
            patches += [
                AttrPatch(fp4_utils, "_flashinfer_fp4_quantize", fi.fp4_quantize, "bound at import: flashinfer.fp4_quantize"),
                AttrPatch(mq, "fp4_quantize", fp4_utils._flashinfer_fp4_quantize_impl, "custom op registered for CUDA only"),
            ]
        if mode == "w4a4" or kind == "moe":
            patches.append(
                AttrPatch(mq, "get_platform", lambda _real=mq.get_platform: _BlackwellPlatform(_real()),
                          "the W4A4 dense path and the NVFP4 MoE method require get_platform().is_blackwell")
            )
        if mode == "w4a4":
            if not torch.cuda.is_available():
                patches.append(AttrPatch(torch.Tensor, "cuda", tensor_cuda_noop,
                                         "W4A4 post-load swizzle ends with .cuda(); no CUDA device here"))
        return patches

    def stand_in(self, mode: Mode, kind: str, modules: dict, ckpt: Any) -> StandIn:
        # The harness runs the scenario under torch.device(...): SGLang's server device is that one.
        fields = dict(fp4_gemm_runner_backend="flashinfer_cutedsl", device=torch.get_default_device().type)
        world_rank = 0
        if kind == "moe":
            fields.update(moe_runner_backend="flashinfer_cutedsl", moe_a2a_backend="none")
            if ckpt.ep_size > 1:  # this process plays one rank of a TP = EP = ep_size launch
                fields.update(tp_size=ckpt.ep_size, ep_size=ckpt.ep_size)
                world_rank = ckpt.ep_rank
        return SGLangStandIn(
            modules,
            self._import_time_patches(mode, kind, modules["flashinfer"]),
            {W4A16_ENV: "1" if mode == "w4a16" else "0"},
            publish_fields=fields,
            world_rank=world_rank,
        )

    # ----------------------------------------------------------------------------------- dense
    @staticmethod
    def _quant_config(awq: bool):
        from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config

        algo = "NVFP4_AWQ" if awq else "NVFP4"
        # packed_modules_mapping: what SGLang's model classes hand the quant config for fused layers.
        return ModelOptFp4Config.from_config({
            "quantization": {"quant_algo": algo, "group_size": 16, "exclude_modules": []},
            "packed_modules_mapping": {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]},
        })

    def build_dense(self, ckpt: DenseLayer, mode: Mode) -> Any:
        from sglang.srt.layers.linear import ColumnParallelLinear, QKVParallelLinear

        qc = self._quant_config(ckpt.pre_quant_scale is not None)
        k, n = ckpt.in_features, ckpt.out_features
        bias = ckpt.bias is not None
        if len(ckpt.shard_sizes) == 3:
            q_heads, kv_heads = qkv_heads(ckpt.shard_sizes)
            layer = QKVParallelLinear(k, _QKV_HEAD, q_heads, kv_heads, bias=bias,
                                      params_dtype=torch.bfloat16, quant_config=qc, prefix="model.layers.0.self_attn.qkv_proj",
                                      parallel_group="replicated")
            layer._harness_shards = ("q", "k", "v")
        elif len(ckpt.shard_sizes) == 1:
            layer = ColumnParallelLinear(k, n, bias=bias, params_dtype=torch.bfloat16, quant_config=qc,
                                         prefix="model.layers.0.mlp.down_proj", parallel_group="replicated")
            layer._harness_shards = (None,)
        else:
            raise ValueError(f"the SGLang adapter builds 1 or 3 (QKV) shards, got {len(ckpt.shard_sizes)}")
        layer._harness_mode = mode
        return layer

    def load_dense(self, layer: Any, ckpt: DenseLayer) -> None:
        """Per shard, the checkpoint tensors ``weight``, ``weight_scale``, ``weight_scale_2`` (0-d),
        ``input_scale`` (0-d), ``pre_quant_scale`` through each parameter's ``weight_loader``, as SGLang's
        model ``load_weights`` does (``weight_loader(param, tensor[, shard_id])``)."""
        load_dense_shards(layer, ckpt, layer._harness_shards)

    def forward_dense(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        out = layer(x)
        return out[0] if isinstance(out, tuple) else out

    # ----------------------------------------------------------------------------------- moe
    def build_moe(self, ckpt: MoECheckpoint, mode: Mode) -> Any:
        from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

        layer = FusedMoE(
            num_experts=ckpt.num_global_experts,
            hidden_size=ckpt.hidden,
            intermediate_size=ckpt.intermediate,
            layer_id=0,
            top_k=ckpt.top_k,
            params_dtype=torch.bfloat16,
            quant_config=self._quant_config(False),
            prefix="model.layers.0.mlp.experts",
            activation="silu",
        )
        return layer

    def load_moe(self, layer: Any, ckpt: MoECheckpoint) -> None:
        """Every global expert's checkpoint tensors through ``FusedMoE.weight_loader`` with SGLang's own
        expert mapping (``make_expert_params_mapping``); the loader keeps this rank's experts."""
        from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

        mapping = FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", ckpt.num_global_experts)
        parts = {"gate_proj": ckpt.gate, "up_proj": ckpt.up, "down_proj": ckpt.down}
        suffixes = ("weight", "weight_scale", "weight_scale_2", "input_scale")
        for param_prefix, weight_prefix, expert_id, shard_id in mapping:
            proj = weight_prefix.split(".")[2]
            for suffix, tensor in zip(suffixes, parts[proj][expert_id]):
                param_name = (param_prefix + suffix).split(".", 1)[1]
                param = getattr(layer, param_name)
                name = f"model.layers.0.mlp.{weight_prefix}{suffix}"
                param.weight_loader(param, tensor.clone(), name, shard_id=shard_id, expert_id=expert_id)

    def forward_moe(self, layer: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        from sglang.srt.layers.moe.topk import StandardTopKOutput

        router_logits = torch.zeros(x.shape[0], layer.num_experts, dtype=torch.float32, device=x.device)
        return layer(x, StandardTopKOutput(topk_weights, topk_ids, router_logits))

    def flashinfer_a2a_prefill(self, ckpt: Any, mode: Any, x: torch.Tensor, topk_ids: torch.Tensor,
                               topk_weights: torch.Tensor, *, modules: dict) -> Any:
        """The FlashInfer-A2A eager-prefill scenario (:mod:`.a2a_prefill`) through SGLang's own MoE runner."""
        from conformance.adapters.sglang.a2a_prefill import flashinfer_a2a_prefill

        return flashinfer_a2a_prefill(self, ckpt, mode, x, topk_ids, topk_weights, modules=modules)

    # ----------------------------------------------------------------------------------- shared
    def post_load(self, layer: Any) -> None:
        layer.quant_method.process_weights_after_loading(layer)

    def graph_captured_params(self, layer: Any) -> dict[str, torch.Tensor]:
        if hasattr(layer, "w13_weight"):
            names = ("w13_weight", "w2_weight", "w13_blockscale_mma", "w2_blockscale_mma", "g1_alphas", "g2_alphas")
            found = {n: getattr(layer, n, None) for n in names}
            scales = getattr(layer, "_cutedsl_scales", None)
            if isinstance(scales, tuple):
                found.update({f"_cutedsl_scales[{i}]": s for i, s in enumerate(scales) if isinstance(s, torch.Tensor)})
            return found
        names = ("weight", "weight_scale_interleaved", "alpha", "input_scale_inv", "pre_quant_scale")
        return {n: getattr(layer, n) for n in names if isinstance(getattr(layer, n, None), torch.Tensor)}
