"""SGLang 0.5.23's FlashInfer-A2A eager-prefill path under the harness (see
:mod:`conformance.engine_harness.a2a_prefill`, which passes the recording emulator tree ``modules`` in and
reads what reached the kernel from it).

The layer is SGLang's real ``FusedMoE`` with ``ModelOptNvFp4FusedMoEMethod``, built, loaded and post-processed
by :class:`~conformance.adapters.sglang.layer_code.SGLangLayerCode` exactly as the MoE cases do. Then the
MoE A2A backend flag is switched to ``flashinfer`` and the quant method's runner is recreated, so SGLang's
``MoeRunner`` picks the fused function it registered for FlashInfer A2A; ``apply`` is called with the
standard dispatch output the FlashInfer dispatcher's eager-prefill all-gather produces (the dispatcher itself
needs a multi-GPU workspace and is not run). One more CPU patch: the MoE runner imports
``fp4_utils.fp4_quantize``, a custom op registered for CUDA only, so it is pointed at SGLang's own Python
implementation (which calls the emulator's ``fp4_quantize``).
"""
from __future__ import annotations

import torch

from conformance.interfaces.layer_code import MoECheckpoint, Mode, PrefillCombine
from conformance.interfaces.standin import AttrPatch


def flashinfer_a2a_prefill(adapter, ckpt: MoECheckpoint, mode: Mode, x: torch.Tensor, topk_ids: torch.Tensor,
                           topk_weights: torch.Tensor, *, modules: dict) -> PrefillCombine:
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.layers.moe.utils import MoeA2ABackend
    from sglang.srt.layers.quantization import fp4_utils
    from sglang.srt.runtime_context import get_flags

    with adapter.stand_in(mode, "moe", modules, ckpt) as stand_in:
        if hasattr(fp4_utils, "_flashinfer_fp4_quantize_impl"):
            stand_in.add_patch(AttrPatch(fp4_utils, "fp4_quantize", fp4_utils._flashinfer_fp4_quantize_impl,
                                         "custom op registered for CUDA only"))
        layer = adapter.build_moe(ckpt, mode)
        adapter.load_moe(layer, ckpt)
        adapter.post_load(layer)
        with get_flags().moe.override(a2a_backend=MoeA2ABackend.FLASHINFER):
            layer.quant_method.create_moe_runner(layer, layer.moe_runner_config)
            routing = StandardTopKOutput(topk_weights, topk_ids, torch.zeros(x.shape[0], ckpt.num_global_experts))
            with torch.no_grad():
                combined = layer.quant_method.apply(layer, StandardDispatchOutput(x, None, routing))
    kind = {"StandardCombineInput": "standard", "FlashinferCombineInput": "flashinfer"}.get(
        type(combined).__name__, type(combined).__name__)
    return PrefillCombine(kind, getattr(combined, "hidden_states", combined))
