"""Example third-party backend: humming-kernels 0.1.19, the W4A16 NVFP4 GEMM vLLM 0.32 runs on Hopper.

vLLM 0.32 prefers humming over Marlin on SM90 for weight-only NVFP4 (``kernels/linear/__init__.py:
init_nvfp4_linear_kernel`` with ``prefers_humming(90)``; the NVFP4 MoE oracle likewise). humming JIT-compiles
its kernels (NVRTC or nvcc, CCCL headers) on first use and caches them (``$HUMMING_CACHE_DIR``)::

    pip install 'humming-kernels[cu13]==0.1.19'
    pytest -m cuda conformance/dense conformance/moe --backend examples.humming_w4a16_backend:HummingW4A16Backend
    pytest -m perf conformance/perf --backend examples.humming_w4a16_backend:HummingW4A16Backend
    python -m examples.humming_w4a16_backend --warm      # compile the perf shapes' kernels once, in parallel

What this adapter does, step by step as vLLM does it (our own code, driving humming's public API):

Dense (``kernels/linear/nvfp4/humming.py`` + ``layers/quantization/utils/humming/linear.py``): ModelOpt's
loader keeps ``weight_global_scale = max(weight_scale_2)`` (the decode scale; ``input_scale`` is dropped for
W4A16_NVFP4); the humming kernel inverts it (``1 / max``) and hands the layer to humming's
*compressed-tensors* ``nvfp4-pack-quantized`` schema, which inverts it back (``1 / (1 / max)`` in fp32: the
alpha humming applies; bit-exact for power-of-two scales, within one fp32 ulp otherwise). Packed codes and
linear E4M3 block scales go in unchanged (same nibble order); ``shape_n_stacks`` are the fused shards' sizes.
BF16 activations (``InputQuantizationMode.Disabled``), N padded to 256 and K to 128, bias in humming's
epilogue, compute config ``{"use_batch_invariant": false, "use_f16_accum": false, "gemm_type": "dense"}``
(vLLM's defaults), one int32 lock buffer of ``8 x SMs`` per layer for stream-K.

MoE (``fused_moe/oracle/nvfp4.py`` HUMMING branch + ``humming/moe.py`` + ``fused_humming_moe.py``
``HummingIndexedExperts``, vLLM's default humming MoE without EP): humming's *modelopt* NVFP4 schema per
sublayer, W13 with ``shape_n_stacks = [I, I]`` and the checkpoint's ``[E, 2]`` (gate, up) decode scales (one
per-expert tensor scale when they agree, otherwise humming keeps per-channel BF16 scales); the indexed GEMM
over (token, slot) rows sorted by expert in blocks of the size humming's tuning table picks (vLLM's
``moe_align_block_size``, written here in torch: an id outside this rank's experts, ``-1`` too, gets no row);
the activation fused into humming's input processing (GEMM1 output BF16, activation in fp32, BF16
intermediate); GEMM2 with ``top_k = 1``; the routing-weighted sum of a token's slots (vLLM's
``moe_fused_mul_sum``) in fp32, in slot order, then BF16.

Declined, with the reason: what vLLM 0.32 does not load (AWQ ``pre_quant_scale``: its ModelOpt NVFP4 linear
registers none), K not a multiple of 16 (vLLM rejects the layer), machines humming cannot serve.
``input_scale`` (W4A4 only) is ignored, as vLLM drops it. Non-contiguous activations are made contiguous
first: humming's launcher requires a contiguous ``a`` (vLLM only ever passes contiguous hidden states).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from conformance.interfaces.kernel import Backend, CaseInfo, DenseLayer, MoEExperts

HUMMING_VERSION = "0.1.19"
INSTALL_HINT = f"pip install 'humming-kernels[cu13]=={HUMMING_VERSION}'"
_BF16_CAPABILITY = (8, 0)  # humming's support matrix: BF16 activations need SM80+
#: vLLM 0.32's compute config (envs VLLM_BATCH_INVARIANT=0, VLLM_HUMMING_USE_F16_ACCUM=0).
COMPUTE_CONFIG = {"use_batch_invariant": False, "use_f16_accum": False}
#: vLLM pads every humming layer to these multiples (``prepare_and_transform_humming_tensors``).
PAD_N, PAD_K = 256, 128
_CT_NVFP4 = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "type": "float",
             "num_bits": 4, "strategy": "group", "group_size": 16}
_MODELOPT_NVFP4 = {"quant_method": "modelopt", "quant_algo": "nvfp4"}
#: The MoE activations as CUDA expressions of humming's fused input processing (``a`` gate, ``b`` up).
_SILU = "a / (1.f + expf(-a))"
_GELU_TANH = "0.5f * a * (1.f + tanhf(0.7978845608028654f * (a + 0.044715f * a * a * a)))"
_OAI = ("[](float a, float b) {{ const float g = fminf(a, {limit}f); const float u = fmaxf(fminf(b, {limit}f), "
        "-{limit}f); return g / (1.f + expf(-{alpha}f * g)) * (u + {beta}f); }}(a, b)")


def _humming_missing() -> str | None:
    try:
        import humming  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install failing at import time
        return f"humming-kernels is not importable ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    return None


def _device_missing() -> str | None:
    if not torch.cuda.is_available():
        return "humming runs on CUDA GPUs only (SM80+ for BF16 activations); no CUDA device is visible"
    cc = torch.cuda.get_device_capability()
    if cc < _BF16_CAPABILITY:
        return f"humming's BF16-activation kernels need SM80+, found SM{cc[0]}{cc[1]}"
    return None


def _locks(device: torch.device) -> torch.Tensor:
    """vLLM's ``create_humming_locks``: 8 int32 counters per SM, zeroed once per layer (stream-K tiles)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return torch.zeros(sms * 8, dtype=torch.int32, device=device)


def _bf16_input_schema(weight_schema):
    """vLLM's W4A16 input schema (``quant_key_to_input_schema(None)``), checked as
    ``check_and_fallback_input_schema`` does for 16-bit activations."""
    from humming.config import InputQuantizationMode
    from humming.schema import HummingInputSchema

    schema = HummingInputSchema(input_quant_mode=InputQuantizationMode.Disabled)
    if not schema.is_compatible_with(weight_schema.to_humming_schema(torch.bfloat16), torch.bfloat16):
        raise RuntimeError(f"humming reports BF16 activations incompatible with {weight_schema}")
    return schema


def _transform(weight_config: dict, tensors: dict, n_stacks: list[int], k: int, device: torch.device,
               num_experts: int | None = None, has_bias: bool = False):
    """Checkpoint tensors -> humming's ``LayerConfig`` and kernel-layout tensors (vLLM's
    ``prepare_humming_linear_layer_config`` / ``_process_single_sublayer``)."""
    from humming.schema import BaseWeightSchema
    from humming.transform import prepare_and_transform_humming_tensors

    schema, converted = BaseWeightSchema.from_config(weight_config).convert_humming(
        tensors=tensors, shape_n_stacks=n_stacks, shape_k_stacks=[k], param_dtype=torch.bfloat16,
        num_experts=num_experts, device=device,
    )
    config, out = prepare_and_transform_humming_tensors(
        tensors=converted, shape_n=sum(n_stacks), shape_k=k, weight_schema=schema,
        input_schema=_bf16_input_schema(schema), num_experts=num_experts, pad_n_to_multiple=PAD_N,
        pad_k_to_multiple=PAD_K, has_bias=has_bias, torch_dtype=torch.bfloat16, device=device,
    )
    return config, out, schema.hadamard_block_size


@dataclass
class HummingDense:
    config: Any  # humming LayerConfig
    tensors: dict[str, torch.Tensor]
    hadamard_block_size: int
    locks: torch.Tensor
    n: int
    k: int


@dataclass
class HummingMoE:
    configs: dict[str, Any]
    tensors: dict[str, dict[str, torch.Tensor]]
    tuning: dict[str, list]
    activation: dict[str, str]
    locks: torch.Tensor
    num_local: int
    num_global: int
    offset: int
    hidden: int
    intermediate: int


class HummingW4A16Backend(Backend):
    """humming-kernels' NVFP4 weight-only GEMM and indexed MoE, prepared as vLLM 0.32 prepares them."""

    name = "humming-w4a16"
    tier = "cuda"

    def __init__(self) -> None:
        # humming's tuner keys its cache on whether it runs under pytest; ask for vLLM's (production) choice.
        os.environ.setdefault("HUMMING_TEST_TUNING_SOURCE", "")

    def version(self) -> str:
        missing = _humming_missing()
        if missing:
            return f"humming-kernels not available ({INSTALL_HINT})"
        import humming

        return f"humming-kernels {humming.__version__} (vLLM 0.32 W4A16 NVFP4 path), torch {torch.__version__}"

    def skip_reason(self, case: CaseInfo) -> str | None:
        reasons = [r for r in (_humming_missing(), _device_missing()) if r]
        if reasons:
            return "; ".join(reasons)
        if case.kind == "dense":
            if "awq" in case.features:
                return ("NVFP4_AWQ pre_quant_scale: vLLM 0.32's ModelOpt NVFP4 linear method registers no "
                        "pre_quant_scale and humming's schema has none, so vLLM cannot serve this layer")
            if case.shape["k"] % 16:
                return f"vLLM rejects NVFP4 layers whose in_features is not a multiple of 16 (K = {case.shape['k']})"
        return None

    # ------------------------------------------------------------------------------------------- dense
    def prepare_dense(self, layer: DenseLayer, device: torch.device) -> HummingDense:
        device = torch.device(device)
        # ModelOpt loader: max over fused shards; humming kernel: its reciprocal (CT convention, humming.py).
        global_scale = 1.0 / layer.weight_scale_2.to(device, torch.float32).max()
        tensors = {
            "weight_packed": layer.weight.to(device).contiguous(),
            "weight_scale": layer.weight_scale.to(device).view(torch.float8_e4m3fn).contiguous(),
            "weight_global_scale": global_scale,
        }
        if layer.bias is not None:
            tensors["bias"] = layer.bias.to(device, torch.bfloat16).contiguous()
        config, out, hadamard = _transform(_CT_NVFP4, tensors, list(layer.shard_sizes), layer.in_features, device,
                                           has_bias=layer.bias is not None)
        return HummingDense(config, out, hadamard, _locks(device), layer.out_features, layer.in_features)

    def run_dense(self, prepared: HummingDense, x: torch.Tensor) -> torch.Tensor:
        from humming.forward import humming_forward

        a = x.reshape(-1, prepared.k).contiguous()
        t = prepared.tensors
        y = humming_forward(
            prepared.config, inputs=a, weight=t["weight"], weight_scale=t.get("weight_scale"),
            bias=t.get("bias"), weight_scale_2=t.get("weight_scale_2"),
            hadamard_block_size=prepared.hadamard_block_size, locks=prepared.locks,
            compute_config=json.dumps({**COMPUTE_CONFIG, "gemm_type": "dense"}),
        )
        return y.view(*x.shape[:-1], prepared.n)

    # --------------------------------------------------------------------------------------------- MoE
    def prepare_moe(self, experts: MoEExperts, device: torch.device) -> HummingMoE:
        from humming.config import GemmType
        from humming.tune import get_heuristics_config

        from reference_impl.moe import is_gated, oai_params

        device = torch.device(device)
        e, h, i = experts.num_local_experts, experts.hidden_size, experts.intermediate_size
        gated = is_gated(experts.activation)
        w13 = {
            "weight": experts.w13.to(device).contiguous(),
            "weight_scale": experts.w13_scale.to(device).view(torch.float8_e4m3fn).contiguous(),
            # (gate, up) as loaded; a non-gated W13 has one scale (the suite repeats it in both columns)
            "weight_scale_2": experts.w13_scale_2.to(device, torch.float32)[:, : 2 if gated else 1].contiguous(),
        }
        w2 = {
            "weight": experts.w2.to(device).contiguous(),
            "weight_scale": experts.w2_scale.to(device).view(torch.float8_e4m3fn).contiguous(),
            "weight_scale_2": experts.w2_scale_2.to(device, torch.float32).reshape(e).contiguous(),
        }
        c13, t13, _ = _transform(_MODELOPT_NVFP4, w13, [i, i] if gated else [i], h, device, num_experts=e)
        c2, t2, _ = _transform(_MODELOPT_NVFP4, w2, [h], i, device, num_experts=e)
        tuning = {
            name: get_heuristics_config(layer_config=cfg, use_f16_accum=False, use_batch_invariant=False,
                                        gemm_type=GemmType.INDEXED)
            for name, cfg in (("w13", c13), ("w2", c2))
        }
        if experts.activation == "swiglu":
            act = {"activation_type": "binary_split", "activation_impl": f"({_SILU}) * b"}
        elif experts.activation == "geglu":
            act = {"activation_type": "binary_split", "activation_impl": f"({_GELU_TANH}) * b"}
        elif experts.activation == "relu2":
            act = {"activation_type": "unary", "activation_impl": "fmaxf(a, 0.f) * fmaxf(a, 0.f)"}
        else:  # swiglu_oai on [gate; up] halves: vLLM's SWIGLUOAI_UNINTERLEAVE with the layer's parameters
            alpha, beta, limit = oai_params(experts.activation_params)
            act = {"activation_type": "binary_split",
                   "activation_impl": _OAI.format(alpha=float(alpha), beta=float(beta), limit=float(limit))}
        return HummingMoE({"w13": c13, "w2": c2}, {"w13": t13, "w2": t2}, tuning, act, _locks(device), e,
                          experts.num_global_experts or e, experts.ep_rank * e, h, i)

    def run_moe(self, prepared: HummingMoE, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        from humming.forward import humming_forward, may_process_input

        p = prepared
        t, k = topk_ids.shape
        local = topk_ids.long() - p.offset
        valid = (local >= 0) & (local < p.num_local)
        # vLLM's estimate_local_valid_shape_m: the expected rows of this rank, for the tuning table
        valid_shape_m = math.ceil(t * k * p.num_local / p.num_global)
        compute = json.dumps({**COMPUTE_CONFIG, "gemm_type": "indexed"})
        rows = t * k
        gate_up = torch.empty(rows, p.configs["w13"].shape_n - p.configs["w13"].pad_shape_n,
                              dtype=torch.bfloat16, device=x.device)
        down = torch.empty(rows, p.hidden, dtype=torch.bfloat16, device=x.device)
        for name, inputs, outputs, top_k in (("w13", x.contiguous(), gate_up, k), ("w2", None, down, 1)):
            if name == "w2":
                inputs, _, _ = may_process_input(
                    p.configs["w2"], inputs=gate_up, layout="normal",
                    outputs=torch.empty(rows, p.intermediate, dtype=torch.bfloat16, device=x.device),
                    **p.activation,
                )
            sorted_ids, expert_ids, padded = align_block_size(local, valid, _block_size(p.tuning[name], valid_shape_m),
                                                              p.num_local)
            weights = p.tensors[name]
            humming_forward(
                p.configs[name], inputs=inputs, weight=weights["weight"], weight_scale=weights["weight_scale"],
                weight_scale_2=weights.get("weight_scale_2"), outputs=outputs, locks=p.locks,
                sorted_ids=sorted_ids, expert_ids=expert_ids, num_tokens_padded=padded, top_k=top_k,
                valid_shape_m=valid_shape_m, compute_config=compute, tuning_config=json.dumps(p.tuning[name]),
            )
        # moe_fused_mul_sum: rows of slots with no local expert were never written (and their weights may be
        # garbage): torch.where never reads them.
        contrib = torch.where(valid.unsqueeze(-1), down.view(t, k, p.hidden).float() * topk_weights.unsqueeze(-1),
                              torch.zeros((), device=x.device))
        return contrib.sum(dim=1).to(torch.bfloat16)


def _block_size(tuning: list, valid_shape_m: int) -> int:
    """The M block of the tuning interval holding ``valid_shape_m`` (vLLM: 64 when none does)."""
    for lower, upper, config in tuning:
        if lower < valid_shape_m <= upper:
            return int(config["block_shape"][0])
    return 64


def align_block_size(local_ids: torch.Tensor, valid: torch.Tensor, block: int, num_local: int):
    """vLLM's ``moe_align_block_size`` semantics in torch: the flat (token * top_k + slot) indices of each local
    expert's rows, ascending, padded with ``T * top_k`` to a multiple of ``block``; ``expert_ids`` per block;
    the padded length as a one-element int32 tensor. Ids outside ``[0, num_local)`` get no row."""
    flat = local_ids.reshape(-1)
    numel = flat.numel()
    keys = torch.where(valid.reshape(-1), flat, torch.full_like(flat, num_local))
    order = torch.sort(keys, stable=True).indices
    counts = torch.bincount(keys, minlength=num_local + 1)[:num_local]
    padded_counts = (counts + block - 1) // block * block
    total = int(padded_counts.sum())
    device = local_ids.device
    sorted_ids = torch.full((max(total, block),), numel, dtype=torch.int32, device=device)
    starts = torch.cumsum(padded_counts, 0) - padded_counts
    src_starts = torch.cumsum(counts, 0) - counts
    n_valid = int(counts.sum())
    if n_valid:
        expert_of = torch.repeat_interleave(torch.arange(num_local, device=device), counts)
        rank_in_expert = torch.arange(n_valid, device=device) - src_starts[expert_of]
        sorted_ids[starts[expert_of] + rank_in_expert] = order[:n_valid].to(torch.int32)
    expert_ids = torch.repeat_interleave(torch.arange(num_local, device=device, dtype=torch.int32),
                                         padded_counts // block)
    if expert_ids.numel() == 0:  # no local rows: one padding block the kernel skips
        expert_ids = torch.zeros(1, dtype=torch.int32, device=device)
    return sorted_ids, expert_ids, torch.tensor([total], dtype=torch.int32, device=device)


def warm_jit_cache(workers: int = 8) -> None:
    """Compile the kernels of the perf tier's shapes once (humming compiles every M interval of a layer on its
    first call; a cache hit afterwards), one process per shape."""
    import multiprocessing as mp

    from conformance.perf.measure import LLM_SHAPES, MOE_SHAPES

    jobs = [("dense", n, k) for n, k in LLM_SHAPES] + [("moe", *s[1:]) for s in MOE_SHAPES]
    with mp.get_context("spawn").Pool(workers) as pool:
        for line in pool.imap_unordered(_warm_one, jobs):
            print(line, flush=True)


def _warm_one(job: tuple) -> str:
    import time

    from conformance.perf.measure import random_experts
    from reference_impl.format.nvfp4 import quantize_modelopt

    start, device, backend = time.perf_counter(), torch.device("cuda"), HummingW4A16Backend()
    if job[0] == "dense":
        _, n, k = job
        q = quantize_modelopt(torch.randn(n, k, device=device))
        p = backend.prepare_dense(DenseLayer(q.packed, q.block_scale, q.weight_scale_2.reshape(1), (n,)), device)
        backend.run_dense(p, torch.randn(1, k, device=device, dtype=torch.bfloat16))
    else:
        _, e, h, i, top_k = job
        p = backend.prepare_moe(random_experts(e, h, i, device), device)
        ids = torch.randint(0, e, (16, top_k), device=device, dtype=torch.int32)
        backend.run_moe(p, torch.randn(16, h, device=device, dtype=torch.bfloat16), ids,
                        torch.full((16, top_k), 1.0 / top_k, device=device))
    torch.cuda.synchronize()
    return f"warmed {job} in {time.perf_counter() - start:.1f} s"


if __name__ == "__main__":
    import sys

    if "--warm" in sys.argv:
        warm_jit_cache()
