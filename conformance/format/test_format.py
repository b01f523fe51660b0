"""NVFP4 format conformance of the reference (``reference_impl.format.nvfp4``), docs/contracts.md section 1.

Thin: the cases and their derivations live in :mod:`conformance.format.cases`; the independent definitions in
:mod:`conformance.format.oracles`. The ``cuda`` cases re-run the encoders on a GPU and demand bit-identical results.
"""
from __future__ import annotations

import hashlib
import math

import pytest
import torch

from conformance.format import cases as C
from conformance.format import inputs as I
from conformance._framework.cases import as_params
from conformance.format.oracles import compare_bits, swizzle_by_tiles, swizzle_offset_spec
from conformance._framework.snapshots import Approx
from reference_impl.format import nvfp4 as F


def _encode(fmt: str, x: torch.Tensor) -> torch.Tensor:
    return F.e2m1_encode(x) if fmt == "e2m1" else F.e4m3_encode(x).view(torch.uint8)


# ----------------------------------------------------------------------------------------- E2M1 / E4M3
@pytest.mark.parametrize("case", as_params(C.ENCODE_CASES))
def test_encode(case: C.EncodeCase):
    got = _encode(case.format, torch.tensor(case.values, dtype=torch.float32)).tolist()
    wrong = [
        f"{v!r} -> 0x{g:02x}, want {[hex(e) for e in e] if isinstance(e, tuple) else hex(e)}"
        for v, g, e in zip(case.values, got, case.expected)
        if g not in (e if isinstance(e, tuple) else (e,))
    ]
    assert not wrong, f"{case.why}: " + "; ".join(wrong[:8]) + (f" (+{len(wrong) - 8} more)" if len(wrong) > 8 else "")


@pytest.mark.parametrize("case", as_params(C.DECODE_CASES))
def test_decode(case: C.DecodeCase):
    raw = torch.tensor([case.code], dtype=torch.uint8)
    got = float((F.e2m1_decode(raw) if case.format == "e2m1" else F.e4m3_decode(raw))[0])
    if math.isnan(case.expected):
        assert math.isnan(got), f"{case.format} 0x{case.code:02x} must decode to NaN, got {got}"
    else:  # equality plus the sign bit, so -0 is told from +0
        assert (got, math.copysign(1, got)) == (case.expected, math.copysign(1, case.expected)), (
            f"{case.format} 0x{case.code:02x} decodes to {got}, bit fields say {case.expected}"
        )


def test_e4m3_decode_accepts_float8_and_bytes_alike():
    raw = torch.arange(256, dtype=torch.uint8)
    a, b = F.e4m3_decode(raw), F.e4m3_decode(raw.view(torch.float8_e4m3fn))
    assert torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0), b.nan_to_num(0))


# ----------------------------------------------------------------------------------------- nibble packing
def test_unpack_every_byte_low_nibble_first():
    got = F.unpack_nibbles(torch.arange(256, dtype=torch.uint8).view(256, 1))
    want = torch.tensor([[b & 0xF, b >> 4] for b in range(256)], dtype=torch.uint8)  # element 2i = low nibble
    assert (m := compare_bits("unpacked codes", got, want)) is None, m


def test_pack_every_code_pair():
    pairs = [(lo, hi) for lo in range(16) for hi in range(16)]
    got = F.pack_nibbles(torch.tensor(pairs, dtype=torch.uint8))
    want = torch.tensor([[lo + 16 * hi] for lo, hi in pairs], dtype=torch.uint8)
    assert (m := compare_bits("packed bytes", got, want)) is None, m


def test_pack_worked_example():
    # codes 1, 2, 3, 4 along K: byte 0 holds elements 0 (low) and 1 (high) -> 0x21; byte 1 -> 0x43
    assert F.pack_nibbles(torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)).tolist() == [[0x21, 0x43]]


def test_pack_odd_k_is_a_clear_error():
    with pytest.raises(ValueError, match="odd number of codes"):
        F.pack_nibbles(torch.zeros(2, 3, dtype=torch.uint8))


def test_unpack_non_uint8_is_a_clear_error():
    with pytest.raises(TypeError, match="must be uint8"):
        F.unpack_nibbles(torch.zeros(2, 3, dtype=torch.int32))


# ----------------------------------------------------------------------------------------- 128x4 swizzle
def _swizzle_input(case: C.SwizzleCase) -> torch.Tensor:
    raw = C.distinct_nonzero_bytes((*case.lead, case.rows, case.scale_cols), seed=case.rows * 1000 + case.scale_cols)
    return raw.view(case.dtype) if case.dtype != torch.uint8 else raw


@pytest.mark.parametrize("case", as_params(C.SWIZZLE_CASES))
def test_swizzle_offsets_padding_and_inverse(case: C.SwizzleCase):
    scales = _swizzle_input(case)
    out = F.swizzle_128x4(scales)
    padded_rows, padded_cols = -(-case.rows // 128) * 128, -(-case.scale_cols // 4) * 4
    assert tuple(out.shape) == (*case.lead, padded_rows, padded_cols) and out.dtype == case.dtype
    spec_offsets = [swizzle_offset_spec(n, k, case.scale_cols) for n in range(case.rows) for k in range(case.scale_cols)]
    for e in range(math.prod(case.lead)):
        logical = scales.view(torch.uint8).reshape(-1, case.rows, case.scale_cols)[e]
        flat = out.view(torch.uint8).reshape(-1, padded_rows * padded_cols)[e]
        at_spec = flat[torch.tensor(spec_offsets)].view(case.rows, case.scale_cols)
        assert (m := compare_bits(f"expert {e}: byte at the contract's offset", at_spec, logical)) is None, m
        tiles = swizzle_by_tiles(logical)
        assert (m := compare_bits(f"expert {e}: tile picture", flat.view(padded_rows, padded_cols), tiles)) is None, m
        padding = torch.ones(flat.numel(), dtype=torch.bool)
        padding[torch.tensor(spec_offsets)] = False
        assert int(flat[padding].count_nonzero()) == 0, "padding bytes must be zero"
    back = F.unswizzle_128x4(out, case.rows, case.scale_cols)
    assert back.dtype == case.dtype
    assert (m := compare_bits("unswizzle(swizzle(s))", back.view(torch.uint8), scales.view(torch.uint8))) is None, m


def test_unswizzle_wrong_size_is_a_clear_error():
    with pytest.raises(ValueError, match="swizzled scales hold"):
        F.unswizzle_128x4(torch.zeros(128, 4, dtype=torch.uint8), 129, 4)


# ----------------------------------------------------------------------------------------- W13 layouts
def _labelled_rows(case: C.W13Case) -> torch.Tensor:
    """Row r holds the value r in every column (and expert e adds 10000 * e), so a row order is readable."""
    rows = torch.arange(2 * case.intermediate).view(-1, 1).expand(-1, case.cols)
    experts = torch.arange(math.prod(case.lead)).view(-1, 1, 1) * 10000
    return (rows + experts).reshape(*case.lead, 2 * case.intermediate, case.cols)


def _row_order(t: torch.Tensor) -> list[int]:
    return (t.reshape(-1, *t.shape[-2:])[0, :, 0]).tolist()


@pytest.mark.parametrize("case", as_params(C.W13_CASES))
def test_w13_checkpoint_deinterleave(case: C.W13Case):
    interleaved = _labelled_rows(case)  # row 2j is gate j, row 2j+1 is up j
    halves = F.deinterleave_gate_up(interleaved)
    assert _row_order(halves) == C.deinterleaved_order(case.intermediate)
    assert torch.equal(F.interleave_gate_up(halves), interleaved), "interleave must invert deinterleave"
    experts = halves.reshape(-1, *halves.shape[-2:])
    for e in range(experts.shape[0]):  # every expert permuted the same way, its own rows only
        assert torch.equal(experts[e] - 10000 * e, experts[0])


@pytest.mark.parametrize("case", as_params(C.W13_CASES))
def test_w13_cutedsl_chunk_interleave(case: C.W13Case):
    halves = _labelled_rows(case)  # rows 0..I-1 gate, I..2I-1 up
    cute = F.to_cutedsl_w13(halves)
    assert _row_order(cute) == C.cutedsl_order(case.intermediate)
    experts = cute.reshape(-1, *cute.shape[-2:])
    for e in range(experts.shape[0]):  # every expert permuted the same way, its own rows only
        assert torch.equal(experts[e] - 10000 * e, experts[0])
    assert torch.equal(F.from_cutedsl_w13(cute), halves), "from_cutedsl_w13 must invert to_cutedsl_w13"


def test_w13_cutedsl_rejects_intermediate_not_multiple_of_64():
    intermediate, cols = C.W13_BAD_INTERMEDIATE
    bad = torch.zeros(2 * intermediate, cols)
    with pytest.raises(ValueError, match="not a multiple of 64"):
        F.to_cutedsl_w13(bad)
    with pytest.raises(ValueError, match="not a multiple of 64"):
        F.from_cutedsl_w13(bad)


# ----------------------------------------------------------------------------------------- recipes, worked examples
def _dequant_by_fields(codes, scale_byte: int, weight_scale_2: float) -> list[float]:
    return [C.E2M1_VALUES[c] * C.E4M3_VALUES[scale_byte] * weight_scale_2 for c in codes]


@pytest.mark.parametrize("case", as_params(C.KERNEL_RECIPE_EXAMPLES))
def test_kernel_recipe_worked_example(case: C.KernelRecipeExample):
    packed, sf = F.quantize_kernel(torch.tensor([case.block]), case.global_sf)
    assert sf.view(torch.uint8).tolist() == [[case.expected_scale_byte]], case.why
    assert F.unpack_nibbles(packed).tolist() == [list(case.expected_codes)], case.why
    ws2 = 1.0 / case.global_sf  # decode scale of an encode scale; exact for the powers of two used here
    got = F.dequantize(packed, sf, ws2)[0].tolist()
    assert got == _dequant_by_fields(case.expected_codes, case.expected_scale_byte, ws2)


@pytest.mark.parametrize("case", as_params(C.MODELOPT_RECIPE_EXAMPLES))
def test_modelopt_recipe_worked_example(case: C.ModelOptRecipeExample):
    q = F.quantize_modelopt(torch.tensor([case.values]))
    assert float(q.weight_scale_2) == case.expected_weight_scale_2, case.why
    assert q.block_scale.view(torch.uint8).tolist() == [list(case.expected_scale_bytes)], case.why
    codes = F.unpack_nibbles(q.packed).tolist()[0]
    assert codes == list(case.expected_codes), case.why
    got = q.dequantize()[0].tolist()
    want = [v for b, byte in enumerate(case.expected_scale_bytes)
            for v in _dequant_by_fields(case.expected_codes[16 * b : 16 * (b + 1)], byte, float(q.weight_scale_2))]
    assert got == torch.tensor(want, dtype=torch.float64).float().tolist()  # e2m1 * e4m3 * ws2: one fp32 rounding


# ----------------------------------------------------------------------------------------- golden vectors
_WS_TOLERANCE_WHY = (
    "a global scale is one IEEE fp32 operation on exactly known operands (amax / 2688, or 2688 / amax), "
    "so it is reproducible bit for bit on any IEEE machine: tolerance 0"
)


@pytest.mark.cpu
@pytest.mark.parametrize("recipe", ["modelopt", "kernel"])
def test_canonical_vectors(recipe: str, golden):
    w = I.canonical_weight()
    weight_id = hashlib.sha256(w.view(torch.uint8).numpy().tobytes()).hexdigest()
    entries: dict = {"weight": "canonical_weight(256, 512, seed=20260101) bf16", "weight_sha256": weight_id}
    if recipe == "modelopt":
        q = F.quantize_modelopt(w)
        entries |= {"packed": q.packed, "block_scale": q.block_scale,
                    "weight_scale_2": Approx(q.weight_scale_2, rtol=0.0, atol=0.0, why=_WS_TOLERANCE_WHY)}
    else:
        amax = w.float().abs().amax()
        global_sf = (F.E2M1_MAX * F.E4M3_MAX) / amax
        packed, sf = F.quantize_kernel(w, global_sf)
        entries |= {"global_sf": Approx(global_sf, rtol=0.0, atol=0.0, why=_WS_TOLERANCE_WHY),
                    "packed": packed, "block_scale_swizzled": F.swizzle_128x4(sf).view(torch.uint8)}
    assert golden == entries


# ----------------------------------------------------------------------------------------- CPU vs CUDA
def _run_on(device: str, case: C.DeviceParityCase) -> list[torch.Tensor]:
    if case.function == "swizzle_128x4":
        swz = next(s for s in C.SWIZZLE_CASES if s.id == case.family)
        return [F.swizzle_128x4(_swizzle_input(swz).to(device)).view(torch.uint8)]
    x = I.ADVERSARIAL_FAMILIES[case.family]().to(case.dtype).to(device)
    if case.function == "e2m1_encode":
        return [F.e2m1_encode(x)]
    if case.function == "e4m3_encode":
        return [F.e4m3_encode(x).view(torch.uint8)]
    if case.function == "quantize_modelopt":
        q = F.quantize_modelopt(x)
        return [q.packed, q.block_scale.view(torch.uint8), q.weight_scale_2.reshape(1).view(torch.uint8)]
    outs = []
    for gs in I.global_scales_for(x):
        packed, sf = F.quantize_kernel(x, gs)
        outs += [packed, F.swizzle_128x4(sf).view(torch.uint8)]
    return outs


@pytest.mark.parametrize("case", as_params(C.DEVICE_PARITY_CASES))
def test_cuda_matches_cpu_bit_for_bit(case: C.DeviceParityCase):
    cpu, cuda = _run_on("cpu", case), _run_on("cuda", case)
    for i, (a, b) in enumerate(zip(cpu, cuda, strict=True)):
        assert b.device.type == "cuda", "the reference must compute on the input's device"
        assert (m := compare_bits(f"{case.function} output {i}", b, a)) is None, m
