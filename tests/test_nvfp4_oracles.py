"""The reference NVFP4 format (reference_impl.nvfp4) against independent oracles, bit for bit:

* ml_dtypes for E2M1 / E4M3 rounding: 10^6 random values per format plus adversarial families;
* FlashInfer's CPU model of the kernel recipe (``flashinfer.batch_invariant.quantization.nvfp4_reference``):
  packed codes and 128x4-swizzled scales, on 10^6 random values and every adversarial input family, in fp32 and
  bf16, under several global scales;
* a numpy/ml_dtypes formulation of the ModelOpt weight recipe.

tests/test_format_mutants.py shows each of these checks reports a mismatch for a broken implementation.
"""
from __future__ import annotations

import pytest
import torch

from conformance import format_inputs as I
from conformance import format_oracles as O
from reference_impl import nvfp4 as F

RANDOM_VALUES = 1_000_000
FORMATS = {
    # format: (reference encoder, oracle check, adversarial families, exponent span of the random values)
    "e2m1": (F.e2m1_encode, O.check_e2m1_encode, I.E2M1_ADVERSARIAL, (-4, 4)),
    "e4m3": (F.e4m3_encode, O.check_e4m3_encode, I.E4M3_ADVERSARIAL, (-12, 10)),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("fmt", FORMATS)
def test_encode_matches_ml_dtypes_on_a_million_random_values(fmt):
    encode, check, _, span = FORMATS[fmt]
    x = I.random_float32(RANDOM_VALUES, seed=11, spread=span)
    assert x.size >= RANDOM_VALUES
    assert (m := check(encode, x)) is None, m


@pytest.mark.parametrize(
    "fmt,family", [(fmt, fam) for fmt, (_, _, fams, _) in FORMATS.items() for fam in fams]
)
def test_encode_matches_ml_dtypes_on_adversarial_values(fmt, family):
    encode, check, families, _ = FORMATS[fmt]
    assert (m := check(encode, families[family])) is None, m


def test_kernel_recipe_matches_flashinfer_on_a_million_random_values():
    g = torch.Generator().manual_seed(12)
    x = torch.randn(1024, 1024, generator=g) * torch.exp2(torch.randint(-8, 8, (1024, 1), generator=g).float())
    global_sf = float(F.E2M1_MAX * F.E4M3_MAX / x.abs().amax())
    assert x.numel() >= RANDOM_VALUES
    assert (m := O.check_kernel_recipe_flashinfer(F.quantize_kernel, F.swizzle_128x4, x, global_sf)) is None, m


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", I.ADVERSARIAL_FAMILIES)
def test_kernel_recipe_matches_flashinfer_on_adversarial_inputs(family, dtype):
    x = I.ADVERSARIAL_FAMILIES[family]().to(DTYPES[dtype])
    for global_sf in I.global_scales_for(x):
        m = O.check_kernel_recipe_flashinfer(F.quantize_kernel, F.swizzle_128x4, x, global_sf)
        assert m is None, f"global_sf={global_sf}: {m}"


def test_adversarial_families_reach_their_corner():
    """The families exercise what their names promise (else a passing comparison would prove little)."""
    def scale_bytes(family):
        return F.quantize_kernel(I.ADVERSARIAL_FAMILIES[family](), 1.0)[1].view(torch.uint8)

    sub = scale_bytes("subnormal-scales")
    assert int(((sub > 0) & (sub < 0x08)).sum()) > 100 and int((sub == 0).sum()) > 0  # subnormal and flushed
    assert int((scale_bytes("saturating-scales") == 0x7E).sum()) > 100
    ties = I.ADVERSARIAL_FAMILIES["code-ties"]()
    packed, sf = F.quantize_kernel(ties, 1.0)
    scaled = ties.view(ties.shape[0], -1, 16) / F.e4m3_decode(sf).unsqueeze(-1)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert float(torch.isin(scaled.abs(), mids).float().mean()) > 0.4  # x / sf lands exactly on midpoints
    assert int((F.quantize_kernel(I.ADVERSARIAL_FAMILIES["zeros"](), 1.0)[1].view(torch.uint8) != 0).sum()) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", [*I.ADVERSARIAL_FAMILIES, "canonical-weight"])
def test_modelopt_recipe_matches_numpy_formulation(family, dtype):
    x = (I.canonical_weight() if family == "canonical-weight" else I.ADVERSARIAL_FAMILIES[family]()).to(DTYPES[dtype])
    assert (m := O.check_modelopt_recipe(F.quantize_modelopt, x)) is None, m
    # an explicit power-of-two weight_scale_2 (as a checkpoint may carry) instead of the amax-derived one
    assert (m := O.check_modelopt_recipe(F.quantize_modelopt, x, 2.0**-8)) is None, f"weight_scale_2=2^-8: {m}"


def test_modelopt_recipe_matches_numpy_on_a_million_random_values():
    g = torch.Generator().manual_seed(13)
    w = torch.randn(1024, 1024, generator=g) * torch.exp2(torch.randint(-10, 4, (1024, 1), generator=g).float())
    assert (m := O.check_modelopt_recipe(F.quantize_modelopt, w)) is None, m


def test_e4m3_nan_input_gives_a_nan_byte():
    got = F.e4m3_encode(torch.tensor([float("nan"), -float("nan")])).view(torch.uint8).tolist()
    assert all(b in (0x7F, 0xFF) for b in got), got
