"""Integration slips planted one at a time in the FlashInfer adapters (conformance/adapters/flashinfer/kernel*.py), driven
in-process through the emulator (FlashInfer 0.7.4's W4A16 API on CPU, answering SM100): each must fail a named
conformance check, and the unmodified adapter must pass the same cases (the probes would otherwise prove nothing).

Complements tests/adapters/test_flashinfer_emulated_tier.py (two slips, through the whole emulated tier in a subprocess):
these are cheaper and cover the rest of the adapter's layout and scale conventions. The emulator is strict where
the real library is (exact 6-D MMA scale view size for cute-dsl, ``x_sf``/``fc2_input_scale`` must be None under
W4A16) and computes from the bytes it is given, so a slip that keeps sizes right shows in the numbers."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conformance.adapters.flashinfer import kernel as fi_dense
from conformance.adapters.flashinfer import moe as fi_moe
from conformance.adapters.flashinfer.kernel import FlashInferBackend
from conformance.adapters.flashinfer.platform import EmulatedFlashInfer
from conformance.dense.checks import failing_checks
from conformance.moe.checks import check_moe_ep_sum, check_moe_within_bound, run_moe_case
from conformance.dense.cases import DENSE_CASES
from conformance.moe.cases import MOE_CASES
from reference_impl.format import nvfp4
from tests.adapters.flashinfer_mutants import _padded_linear_scales

emulator = pytest.importorskip("reference_impl.flashinfer_emulator")

DENSE = {c.id: c for c in DENSE_CASES if c.tier == "cpu"}
MOE = {c.id: c for c in MOE_CASES if c.tier == "cpu"}
#: N = 200 (a partial 128-row scale block, K/16 = 8), N = 96 with K/16 = 5 and N = 64 with K/16 = 3 (the swizzle
#: pads the columns to 8 and to 4): together they expose every dense scale-layout slip; all carry input scales.
DENSE_PROBES = ("cpu-n200-not-mult-128", "cpu-k80-mult16-not64", "cpu-k48-mult16-not64")
#: 64-row chunks matter (I = 192), an I = 128 gated case (a 128-row chunk is then no interleave), EP over 2
#: ranks; all carry input scales and per-expert decode scales.
MOE_PROBES = ("t7_e8_k2_h192_i192", "t128_e8_k2_geglu", "t128_e8_k2_ep2")


def _backend(gemm_backend: str) -> FlashInferBackend:
    return FlashInferBackend(gemm_backend, emulator, platform=EmulatedFlashInfer())


# ---- dense slips --------------------------------------------------------------------------------------------

def _cols_padded_to_8(scales: torch.Tensor) -> torch.Tensor:
    """128x4 swizzle of scales whose K/16 columns were padded to a multiple of 8 first (wrong tile width)."""
    raw = scales.view(torch.uint8)
    padded = torch.nn.functional.pad(raw, (0, (-raw.shape[-1]) % 8))
    return nvfp4.swizzle_128x4(padded).view(scales.dtype)


def _last_partial_row_block_zeroed(scales: torch.Tensor) -> torch.Tensor:
    """The swizzle, but the rows of a trailing partial 128-row block are lost (zero scales)."""
    full = scales.shape[-2] // 128 * 128
    kept = scales.clone()
    kept.view(torch.uint8)[..., full:, :] = 0
    return nvfp4.swizzle_128x4(kept)


class _AlphaWithInputScale(FlashInferBackend):
    """alpha = max(weight_scale_2) * max(input_scale): the W4A4 activation scale folded into a W4A16 GEMM."""

    def prepare_dense(self, layer, device):
        prepared = super().prepare_dense(layer, device)
        return dataclasses.replace(prepared, alpha=prepared.alpha * layer.input_scale.float().max().to(device))


DENSE_SLIPS = {  # name -> (module attribute to replace, replacement) or a backend class
    "swizzle_skipped": ("swizzle_128x4", lambda s: s.contiguous()),
    "linear_scales_padded_to_tile": ("swizzle_128x4", _padded_linear_scales),
    "scale_columns_padded_to_8": ("swizzle_128x4", _cols_padded_to_8),
    "partial_row_block_dropped": ("swizzle_128x4", _last_partial_row_block_zeroed),
    "alpha_includes_input_scale": _AlphaWithInputScale,
}


#: Slips that give the right numbers on a backend on these probes, on the real library too (not a blind spot of
#: the emulator): cudnn unswizzles by offset from the start of the buffer (gemm_bf16_fp4._unswizzle_sf_128x4), and
#: with a single 128-row tile the extra column padding lies after every byte it reads; cute-dsl refuses the
#: buffer (convert_sf_to_mma_layout wants the exact element count).
#: (No CPU probe has N > 128 with K/16 % 4 != 0, where cudnn would read a wrong byte.)
HARMLESS = {("scale_columns_padded_to_8", "cudnn")}


@pytest.mark.parametrize("gemm_backend", ["cute-dsl", "cudnn"])
def test_unmodified_dense_adapter_passes_the_probes(gemm_backend):
    for case_id in DENSE_PROBES:
        assert failing_checks(_backend(gemm_backend), DENSE[case_id]) == {}, case_id


@pytest.mark.parametrize("slip,gemm_backend", [(s, b) for s in DENSE_SLIPS for b in ("cute-dsl", "cudnn")
                                                if (s, b) not in HARMLESS])
def test_dense_adapter_slip_fails_a_named_check(slip, gemm_backend, monkeypatch):
    planted = DENSE_SLIPS[slip]
    if isinstance(planted, type):
        backend = planted(gemm_backend, emulator, platform=EmulatedFlashInfer())
    else:
        monkeypatch.setattr(fi_dense, planted[0], planted[1])
        backend = _backend(gemm_backend)
    caught = {}
    for case_id in DENSE_PROBES:
        try:
            failures = failing_checks(backend, DENSE[case_id])
        except (ValueError, RuntimeError) as exc:  # FlashInfer's own size check refused the buffer
            failures = {"raised": f"{type(exc).__name__}: {exc}"}
        if failures:
            caught[case_id] = failures
    assert caught, f"{slip} on {gemm_backend} passed every probe"
    assert any("check_within_error_bound" in f or "raised" in f for f in caught.values()), caught


# ---- MoE slips ----------------------------------------------------------------------------------------------

def _chunk(rows: int):
    original = fi_moe.to_cutedsl_w13
    return lambda w13, chunk_rows=nvfp4.W13_CHUNK_ROWS: original(w13, rows)


def _gate_up_swapped(w13: torch.Tensor, chunk_rows: int = nvfp4.W13_CHUNK_ROWS) -> torch.Tensor:
    half = w13.shape[-2] // 2
    return nvfp4.to_cutedsl_w13(torch.cat((w13[..., half:, :], w13[..., :half, :]), dim=-2), chunk_rows)


def _layout_edit(edit):
    original = fi_moe.build_kernel_layout

    def build(experts, device="cpu", chunk_rows=nvfp4.W13_CHUNK_ROWS):
        return edit(original(experts, device, chunk_rows), experts)
    return build


MOE_SLIPS = {
    "w13_gate_up_order": ("to_cutedsl_w13", _gate_up_swapped),
    "w13_chunk_32_rows": ("to_cutedsl_w13", _chunk(32)),
    "w13_chunk_128_rows": ("to_cutedsl_w13", _chunk(128)),
    "linear_scales_padded_to_tile": ("swizzle_128x4", _padded_linear_scales),
    "w2_alpha_from_w13": ("build_kernel_layout", _layout_edit(lambda w, e: dataclasses.replace(w, w2_alpha=w.w1_alpha))),
    "w1_alpha_includes_input_scale": ("build_kernel_layout", _layout_edit(lambda w, e: dataclasses.replace(
        w, w1_alpha=w.w1_alpha * e.w13_input_scale.float().reshape(w.w1_alpha.shape[0], -1).amax(1)))),
}


def _moe_failures(backend, case_id: str) -> str | None:
    case = MOE[case_id]
    try:
        run = run_moe_case(backend, case)
        check_moe_within_bound(run)
        if case.ep_size > 1:
            check_moe_ep_sum(run)
    except AssertionError as exc:
        return str(exc).splitlines()[0]
    except (ValueError, RuntimeError) as exc:  # FlashInfer's own checks refused the tensors
        return f"raised {type(exc).__name__}: {exc}"
    return None


def test_unmodified_moe_adapter_passes_the_probes():
    backend = _backend(fi_dense.MOE_GEMM_BACKEND)
    assert {c: _moe_failures(backend, c) for c in MOE_PROBES} == dict.fromkeys(MOE_PROBES)


@pytest.mark.parametrize("slip", list(MOE_SLIPS))
def test_moe_adapter_slip_fails_a_named_check(slip, monkeypatch):
    attr, replacement = MOE_SLIPS[slip]
    monkeypatch.setattr(fi_moe, attr, replacement)
    backend = _backend(fi_dense.MOE_GEMM_BACKEND)
    caught = {c: f for c in MOE_PROBES if (f := _moe_failures(backend, c))}
    assert caught, f"{slip} passed every MoE probe"
    assert any("[moe_" in f or f.startswith("raised") for f in caught.values()), caught
