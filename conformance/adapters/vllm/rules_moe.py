"""vLLM 0.32's NVFP4 MoE backend choice, asked of its own ``select_nvfp4_moe_backend``
(``model_executor/layers/fused_moe/oracle/nvfp4.py``) as ``ModelOptNvFp4FusedMoE.__init__`` asks it.

Call under :func:`conformance.adapters.vllm._import.emulated_platform` (the experts' device probes read the
platform). Importing an experts class is part of the choice (``backend_to_kernel_cls``); a class whose module
cannot be imported on this host fails the question with that error, it is never guessed.
"""
from __future__ import annotations

from typing import Any

import torch


def moe_config(moe_backend: str = "auto", *, hidden: int = 256, intermediate: int = 256, experts: int = 8,
               top_k: int = 2) -> Any:
    """A single-GPU SwiGLU MoE layer config (what ``FusedMoE`` builds for a Llama-style MoE), with
    ``--moe-backend`` = ``moe_backend``."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )

    return FusedMoEConfig(
        num_experts=experts, experts_per_token=top_k, hidden_dim=hidden, intermediate_size=intermediate,
        num_local_experts=experts, num_logical_experts=experts, activation=MoEActivation.SILU, device="cpu",
        routing_method=RoutingMethodType.Renormalize, moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=torch.bfloat16, moe_backend=moe_backend, intermediate_size_per_partition=intermediate)


def select_backend(moe_backend: str, *, use_a16: bool) -> dict[str, str]:
    """``{"backend": NvFp4MoeBackend value, "experts": experts class}``; vLLM's exception propagates."""
    from vllm.model_executor.layers.fused_moe.oracle import nvfp4
    from vllm.model_executor.layers.quantization.utils.quant_utils import kNvfp4Dynamic, kNvfp4Static

    backend, experts = nvfp4.select_nvfp4_moe_backend(
        config=moe_config(moe_backend), weight_key=kNvfp4Static, activation_key=None if use_a16 else kNvfp4Dynamic)
    return {"backend": backend.value, "experts": experts.__name__}


def moe_backend_choice(moe_backend: str, *, use_a16: bool) -> str:
    """The choice as text, for reasons shown to users: the backend, or the error vLLM raises."""
    try:
        chosen = select_backend(moe_backend, use_a16=use_a16)
    except Exception as exc:  # noqa: BLE001 - the refusal is the answer
        return f"refused ({type(exc).__name__}: {exc})"
    return f"{chosen['backend']} ({chosen['experts']})"
