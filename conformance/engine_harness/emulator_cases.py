"""Bad-input cases for the FlashInfer W4A16 API, as data: each names the FlashInfer check it mirrors
(``source``: file:function in FlashInfer 0.7.4), builds its inputs on a device, calls one entry point of
an API namespace (the emulator, or the real ``flashinfer`` on a B200) and states the exception expected.

``tests/engine_harness/test_emulator_validation.py`` runs them against the emulator (CPU); the ``b200`` tier of
``conformance/engine_harness/test_emulator_vs_flashinfer.py`` runs the same cases against real FlashInfer, so the two
can only agree by raising the same exception type. ``real_raises=False`` marks checks that exist only in
the emulator, where the real kernel reads out of bounds (no defined outcome to compare with).
"""
from __future__ import annotations

import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

N, K, M = 128, 64, 4  # dense: one 128-row swizzle tile, K_sf = 4 (exactly one column tile)
E, H, I, T, TOP_K = 2, 128, 128, 3, 2  # MoE: two local experts, one 64-row up/gate group pair


@dataclass(frozen=True)
class RaisesNamed:
    """An exception whose class *name* is ``exc_name`` (so the emulator's and FlashInfer's own
    ``BackendSupportedError`` compare equal) and whose message matches ``match``."""

    exc_name: str
    match: str = ""

    def check(self, exc: BaseException) -> None:
        names = [c.__name__ for c in type(exc).__mro__]
        assert self.exc_name in names, f"expected {self.exc_name} matching {self.match!r}, got {type(exc).__name__}: {exc}"
        assert re.search(self.match, str(exc)), f"{type(exc).__name__} message {str(exc)!r} does not match {self.match!r}"


@dataclass(frozen=True)
class BadInputCase:
    id: str
    source: str
    call: Callable[[Any, torch.device], Any]
    expect: RaisesNamed
    real_raises: bool = True
    tier: str = "cpu"


# ------------------------------------------------------------------------------------------ inputs
def _gen(device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(1234)


def _weight(device, n=N, k=K) -> torch.Tensor:
    return torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=_gen(device))


def _swizzled_sf(device, n=N, k=K) -> torch.Tensor:
    """Valid 128x4-swizzled e4m3 scales (values 0.5..8, all positive) of the padded size."""
    rows, cols = (n + 127) // 128 * 128, (k // 16 + 3) // 4 * 4
    vals = torch.randint(0, 5, (rows, cols), device=device, generator=_gen(device)).float()
    return (2.0**vals / 2).to(torch.float8_e4m3fn)


def _alpha(device) -> torch.Tensor:
    return torch.tensor([0.01], dtype=torch.float32, device=device)


def _act(device, m=M, k=K, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(m, k, device=device, generator=_gen(device)).to(dtype)


def _prepared(api, device, backend="cute-dsl"):
    return api.prepare_bf16_fp4_weights(_weight(device), _swizzled_sf(device), _alpha(device), backend=backend)


def _mm(api, device, a=None, backend="cute-dsl", **kw):
    b, sf, alpha = _prepared(api, device)
    return api.mm_bf16_fp4(_act(device) if a is None else a, b, sf, alpha, backend=backend, **kw)


def moe_inputs(api, device, t=T) -> dict:
    """Well-formed W4A16 MoE operands (random codes, positive scales) for :meth:`CuteDslMoEWrapper.run`."""
    w1 = torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8, device=device, generator=_gen(device))
    w2 = torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8, device=device, generator=_gen(device))
    sf1 = api.convert_sf_to_mma_layout(_swizzled_sf(device, E * 2 * I, H).view(torch.uint8).reshape(-1), m=2 * I, k=H, num_groups=E)
    sf2 = api.convert_sf_to_mma_layout(_swizzled_sf(device, E * H, I).view(torch.uint8).reshape(-1), m=H, k=I, num_groups=E)
    ids = torch.randint(0, E, (t, TOP_K), dtype=torch.int32, device=device, generator=_gen(device))
    return dict(
        x=torch.randn(t, H, device=device, generator=_gen(device)).to(torch.bfloat16) / 4,
        x_sf=None, token_selected_experts=ids,
        token_final_scales=torch.full((t, TOP_K), 0.5, dtype=torch.float32, device=device),
        w1_weight=w1, w1_weight_sf=sf1, w1_alpha=torch.full((E,), 1e-3, device=device),
        fc2_input_scale=None, w2_weight=w2, w2_weight_sf=sf2, w2_alpha=torch.full((E,), 1e-3, device=device),
    )


def moe_wrapper(api, device, **kw):
    args = dict(num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I, quant_mode="w4a16", device=str(device))
    args.update(kw)
    return api.CuteDslMoEWrapper(**args)


def _moe_run(api, device, **override):
    inputs = moe_inputs(api, device)
    inputs.update(override(device) if callable(override) else {k: v(device) if callable(v) else v for k, v in override.items()})
    return moe_wrapper(api, device).run(**inputs)


# ------------------------------------------------------------------------------------------ cases
_P = "flashinfer/gemm/gemm_bf16_fp4.py:prepare_bf16_fp4_weights"
_MM = "flashinfer/gemm/gemm_bf16_fp4.py:_check_mm_bf16_fp4_problem_size"
_BR = "flashinfer/utils.py:backend_requirement.wrapper"
_CUTE = "flashinfer/gemm/gemm_bf16_fp4_cute_dsl.py:_compute_cute_dsl_sm100"
_RUN = "flashinfer/fused_moe/cute_dsl/fused_moe.py:CuteDslMoEWrapper.run"
_RUNNER = "flashinfer/fused_moe/cute_dsl/tuner.py:CuteDslFusedMoEW4A16Runner.forward"
_INIT = "flashinfer/fused_moe/cute_dsl/fused_moe.py:CuteDslMoEWrapper.__init__"

BAD_INPUT_CASES: list[BadInputCase] = [
    BadInputCase("prepare-b-3d", _P, lambda api, d: api.prepare_bf16_fp4_weights(
        _weight(d).reshape(1, N, K // 2), _swizzled_sf(d), _alpha(d), backend="cute-dsl"), RaisesNamed("ValueError", "b must be 2-D")),
    BadInputCase("prepare-b-int8", _P, lambda api, d: api.prepare_bf16_fp4_weights(
        _weight(d).view(torch.int8), _swizzled_sf(d), _alpha(d), backend="cute-dsl"), RaisesNamed("TypeError", "b must be uint8")),
    BadInputCase("prepare-k-not-multiple-of-16", _P, lambda api, d: api.prepare_bf16_fp4_weights(
        _weight(d, k=24), _swizzled_sf(d), _alpha(d), backend="cute-dsl"), RaisesNamed("ValueError", "multiple of block_size")),
    BadInputCase("prepare-linear-scales-too-small", _P, lambda api, d: api.prepare_bf16_fp4_weights(
        _weight(d, n=64), _swizzled_sf(d)[:64, :4], _alpha(d), backend="cute-dsl"),
        RaisesNamed("ValueError", "b_descale has 256 bytes .* requires at least 512")),
    BadInputCase("prepare-alpha-0d", _P, lambda api, d: api.prepare_bf16_fp4_weights(
        _weight(d), _swizzled_sf(d), _alpha(d).reshape(()), backend="cute-dsl"), RaisesNamed("ValueError", r"alpha must be shape \(1,\)")),
    BadInputCase("prepare-alpha-two-elements", _P, lambda api, d: api.prepare_bf16_fp4_weights(
        _weight(d), _swizzled_sf(d), _alpha(d).repeat(2), backend="cute-dsl"), RaisesNamed("ValueError", r"alpha must be shape \(1,\)")),
    BadInputCase("prepare-alpha-bf16", _P, lambda api, d: api.prepare_bf16_fp4_weights(
        _weight(d), _swizzled_sf(d), _alpha(d).bfloat16(), backend="cute-dsl"), RaisesNamed("TypeError", "alpha must be float32")),
    BadInputCase("prepare-unknown-backend", _P, lambda api, d: api.prepare_bf16_fp4_weights(
        _weight(d), _swizzled_sf(d), _alpha(d), backend="cutlass"), RaisesNamed("ValueError", "Unknown backend 'cutlass'")),
    BadInputCase("prepare-cute-dsl-oversized-scales", "flashinfer/cute_dsl/utils.py:convert_sf_to_mma_layout",
        lambda api, d: api.prepare_bf16_fp4_weights(_weight(d), _swizzled_sf(d, n=256), _alpha(d), backend="cute-dsl"),
        RaisesNamed("ValueError", "Scale factor tensor has 1024 elements, expected 512")),
    BadInputCase("mm-unknown-backend", _BR, lambda api, d: _mm(api, d, backend="cutlass"),
        RaisesNamed("BackendSupportedError", "does not support backend 'cutlass'")),
    BadInputCase("mm-a-3d", _MM, lambda api, d: _mm(api, d, a=_act(d).reshape(1, M, K)), RaisesNamed("ValueError", "a must be 2-D")),
    BadInputCase("mm-a-fp16", _MM, lambda api, d: _mm(api, d, a=_act(d, dtype=torch.float16)), RaisesNamed("TypeError", "a must be bfloat16")),
    BadInputCase("mm-out-dtype-fp32", _MM, lambda api, d: _mm(api, d, out_dtype=torch.float32),
        RaisesNamed("ValueError", "out_dtype must be bfloat16 or float16")),
    BadInputCase("mm-block-size-32", _MM, lambda api, d: _mm(api, d, block_size=32), RaisesNamed("ValueError", "block_size must be 16")),
    BadInputCase("mm-cute-dsl-fp16-output", _CUTE, lambda api, d: _mm(api, d, out_dtype=torch.float16),
        RaisesNamed("NotImplementedError", "requires a bfloat16 output")),
    BadInputCase("mm-k-mismatch", _CUTE, lambda api, d: _mm(api, d, a=_act(d, k=2 * K)), RaisesNamed("ValueError", "encodes K=64")),
    BadInputCase("mm-cute-dsl-int32-weight", "flashinfer/gemm/gemm_bf16_fp4.py:_cute_dsl_bf16_fp4_requirement",
        lambda api, d: api.mm_bf16_fp4(_act(d), _weight(d).view(torch.int32), _prepared(api, d)[1], _alpha(d), backend="cute-dsl"),
        RaisesNamed("ValueError", "expects the torch.uint8 weight")),
    BadInputCase("mm-native-backend-on-sm100", _BR, lambda api, d: _mm(api, d, backend="cute-dsl-native"),
        RaisesNamed("BackendSupportedError", "does not support backend 'cute-dsl-native' with capability 10[03]")),
    BadInputCase("moe-x-sf-under-w4a16", _RUN, lambda api, d: _moe_run(api, d, x_sf=lambda d: torch.ones(T, H // 16, device=d).to(torch.float8_e4m3fn)),
        RaisesNamed("ValueError", "x_sf, fc2_input_scale, and per_token_scale must be None")),
    BadInputCase("moe-fc2-input-scale-under-w4a16", _RUN, lambda api, d: _moe_run(api, d, fc2_input_scale=lambda d: torch.ones(1, device=d)),
        RaisesNamed("ValueError", "x_sf, fc2_input_scale, and per_token_scale must be None")),
    BadInputCase("moe-x-uint8-under-w4a16", _RUNNER, lambda api, d: _moe_run(
        api, d, x=lambda d: torch.zeros(T, H // 2, dtype=torch.uint8, device=d)), RaisesNamed("TypeError", "W4A16 requires x.dtype=torch.bfloat16")),
    BadInputCase("moe-routing-weights-bf16", _RUNNER, lambda api, d: _moe_run(
        api, d, token_final_scales=lambda d: torch.full((T, TOP_K), 0.5, device=d).bfloat16()), RaisesNamed("TypeError", "token_final_scales.dtype")),
    BadInputCase("moe-x-wrong-hidden", _RUNNER, lambda api, d: _moe_run(
        api, d, x=lambda d: torch.zeros(T, H // 2, dtype=torch.bfloat16, device=d)), RaisesNamed("ValueError", "x must have shape")),
    BadInputCase("moe-w1-rows-not-2I", "flashinfer/fused_moe/cute_dsl/blackwell/moe_w4a16.py:launch_w4a16_moe",
        lambda api, d: _moe_run(api, d, w1_weight=lambda d: torch.zeros(E, I, H // 2, dtype=torch.uint8, device=d)),
        RaisesNamed("ValueError", "w1_weight dim 1 must be 256 for Swiglu")),
    BadInputCase("moe-unknown-quant-mode", _INIT, lambda api, d: moe_wrapper(api, d, quant_mode="w4a32"),
        RaisesNamed("ValueError", "quant_mode must be 'w4a4', 'w4a8', 'w4a16', or 'mxfp8'")),
    BadInputCase("moe-w4a16-fp16-output", "flashinfer/fused_moe/cute_dsl/tuner.py:CuteDslFusedMoEW4A16Runner.__init__",
        lambda api, d: moe_wrapper(api, d, output_dtype=torch.float16), RaisesNamed("ValueError", "W4A16 only supports BF16 output")),
    BadInputCase("moe-w4a16-silu-not-gated", "flashinfer/fused_moe/cute_dsl/moe_utils.py:normalize_cute_dsl_moe_activation_type",
        lambda api, d: moe_wrapper(api, d, activation_type=2), RaisesNamed("ValueError", "Unsupported activation_type")),
    BadInputCase("fp4-quantize-sf-vec-8", "flashinfer/quantization/fp4_quantization.py:fp4_quantize",
        lambda api, d: api.fp4_quantize(_act(d), torch.ones(1, device=d), sf_vec_size=8), RaisesNamed("NotImplementedError", "16 or 32")),
    BadInputCase("fp4-quantize-unknown-backend", "flashinfer/quantization/fp4_quantization.py:fp4_quantize",
        lambda api, d: api.fp4_quantize(_act(d), torch.ones(1, device=d), backend="triton"), RaisesNamed("ValueError", "Unknown backend: triton")),
    BadInputCase("mm-fp4-k-mismatch", "flashinfer/gemm/gemm_base.py:_check_mm_fp4_problem_size",
        lambda api, d: api.mm_fp4(_weight(d, n=M), _weight(d, k=2 * K).T, _swizzled_sf(d), _swizzled_sf(d).T, _alpha(d),
                                  torch.bfloat16, backend="cutlass"), RaisesNamed("ValueError", "K dimension mismatch")),
    BadInputCase("mm-fp4-alpha-bf16", "flashinfer/gemm/gemm_base.py:_check_mm_fp4_problem_size",
        lambda api, d: api.mm_fp4(_weight(d, n=M), _weight(d).T, _swizzled_sf(d), _swizzled_sf(d).T, _alpha(d).bfloat16(),
                                  torch.bfloat16, backend="cutlass"), RaisesNamed("ValueError", "alpha must be a float tensor")),
    BadInputCase("moe-alpha-shorter-than-local-experts", "emulator only: blackwell/moe_w4a16.py reads alpha by raw pointer",
        lambda api, d: _moe_run(api, d, w1_alpha=lambda d: torch.full((1,), 1e-3, device=d)),
        RaisesNamed("ValueError", "reads 8 bytes"), real_raises=False),
]


def emulator_api() -> types.SimpleNamespace:
    import reference_impl.flashinfer_emulator as fe

    return types.SimpleNamespace(
        prepare_bf16_fp4_weights=fe.prepare_bf16_fp4_weights, mm_bf16_fp4=fe.mm_bf16_fp4, mm_fp4=fe.mm_fp4,
        fp4_quantize=fe.fp4_quantize, CuteDslMoEWrapper=fe.CuteDslMoEWrapper,
        convert_sf_to_mma_layout=fe.convert_sf_to_mma_layout, name="flashinfer_emulator",
    )


def flashinfer_api() -> types.SimpleNamespace:
    """The real FlashInfer entry points (import errors propagate: the caller turns them into a skip)."""
    import flashinfer
    from flashinfer.cute_dsl.utils import convert_sf_to_mma_layout

    return types.SimpleNamespace(
        prepare_bf16_fp4_weights=flashinfer.prepare_bf16_fp4_weights, mm_bf16_fp4=flashinfer.mm_bf16_fp4,
        mm_fp4=flashinfer.mm_fp4, fp4_quantize=flashinfer.fp4_quantize, CuteDslMoEWrapper=flashinfer.CuteDslMoEWrapper,
        convert_sf_to_mma_layout=convert_sf_to_mma_layout, name=f"flashinfer {flashinfer.__version__}",
    )
