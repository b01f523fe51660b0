"""The reference NVFP4 format (reference_impl.format.nvfp4) against independent oracles, bit for bit:

* ml_dtypes for E2M1 / E4M3 rounding: 10^6 random values per format plus adversarial families;
* FlashInfer's CPU model of the kernel recipe (``flashinfer.batch_invariant.quantization.nvfp4_reference``):
  packed codes and 128x4-swizzled scales, on 10^6 random values and every adversarial input family, in fp32 and
  bf16, under several global scales;
* a numpy/ml_dtypes formulation of the ModelOpt weight recipe.

tests/format/test_format_mutants.py shows each of these checks reports a mismatch for a broken implementation.
"""
from __future__ import annotations

import pytest
import torch

from conformance.format import inputs as I
from conformance.format import oracles as O
from reference_impl.format import nvfp4 as F

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


# ----------------------------------------------------------------------------------------- NVIDIA ModelOpt itself
def _modelopt_or_skip() -> None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("nvidia-modelopt")
    except PackageNotFoundError:
        pytest.skip("nvidia-modelopt is not installed (ci/install-test-deps.sh installs it --no-deps, CPU only)")
    if installed != O.MODELOPT_VERSION:
        pytest.skip(f"nvidia-modelopt {installed} installed; the ModelOpt recipe is pinned to {O.MODELOPT_VERSION}")


def _explicit_scales(x: torch.Tensor) -> list[float | None]:
    """weight_scale_2 values to quantize ``x`` with: derived from amax (None), a power of two, one that saturates
    every block scale at 448 (1/1000 of the amax-derived one) and one that pushes them below E4M3's range (x1e4)."""
    amax = float(x.float().abs().amax())
    derived = amax / 2688.0 if amax > 0 else 1.0
    return [None, 2.0**-8, derived / 1000.0, derived * 1e4]


def test_modelopt_recipe_matches_nvidia_modelopt():
    """``quantize_modelopt`` vs NVIDIA ModelOpt 0.47.0's own quantizer (the calls its HF export makes), 0 differing
    bytes on: 10^6 random values (fp32, bf16); every adversarial family (ties of E2M1 codes and of ModelOpt's
    E4M3 scales, zero blocks, outliers, subnormal / underflowing / saturating scales) under four weight_scale_2
    values each; a real-model-like bf16 weight; fused q/k/v and gate/up shards quantized with the shared
    weight_scale_2 ModelOpt derives for them (:func:`_fused_shard_inputs`).
    One test (not one per input) so only one xdist worker pays ModelOpt's ~10 s import."""
    _modelopt_or_skip()
    g = torch.Generator().manual_seed(14)
    random = torch.randn(1024, 1024, generator=g) * torch.exp2(torch.randint(-10, 4, (1024, 1), generator=g).float())
    inputs: dict[str, tuple[torch.Tensor, float | None]] = {}
    for dtype in DTYPES:
        inputs[f"random-1M-{dtype}"] = (random.to(DTYPES[dtype]), None)
        for family, make in I.ADVERSARIAL_FAMILIES.items():
            x = make().to(DTYPES[dtype])
            for ws2 in _explicit_scales(x):
                if family == "zeros" and ws2 is None:
                    continue  # weight_scale_2 = 0: the documented divergence, checked below
                inputs[f"{family}-{dtype}-ws2={ws2}"] = (x, ws2)
    real = I.real_model_like_weight()
    inputs["real-model-like-bf16"] = (real, None)
    inputs.update(_fused_shard_inputs(real))
    mismatches = {name: str(m) for name, (x, ws2) in inputs.items()
                  if (m := O.check_modelopt_package(F.quantize_modelopt, x, ws2)) is not None}
    assert not mismatches, f"{len(mismatches)} of {len(inputs)} inputs differ from ModelOpt: {mismatches}"
    assert len(inputs) >= 80


def _fused_shard_inputs(real: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Fused shards as ModelOpt's HF export writes them (``preprocess_linear_fusion``: one amax, the max over the
    shards, hence one ``weight_scale_2``), with the shared scale derived by ModelOpt itself
    (``NVFP4QTensor.get_weights_scaling_factor_2`` of the concatenated shards); asserts the reference's
    ``decode_scale_from_amax(max of the shard amaxes)`` has the same bits. Shards of the real-model-like bf16
    weight: q/k/v at gains 1, 3, 1/4 and a 2^-8 one whose block scales span normal, subnormal and below-range
    ideal values (ModelOpt clamps those to 2^-9: asserted, so the corner is reached); an MoE expert's gate/up pair
    (gate 1.37x up)."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    def gain(t: torch.Tensor, g: float) -> torch.Tensor:
        return (t.float() * g).bfloat16()

    groups = {
        "qkv": {"q": real[:512], "k": gain(real[512:768], 3), "v": gain(real[768:896], 0.25),
                "v-small": gain(real[896:1024], 2.0**-8)},
        "gate-up": {"gate": gain(real[:256, :1024], 1.37), "up": real[256:512, :1024]},
    }
    inputs = {}
    for group, shards in groups.items():
        shared = NVFP4QTensor.get_weights_scaling_factor_2(torch.cat(list(shards.values()))).float().reshape(())
        ours = F.decode_scale_from_amax(torch.stack([s.float().abs().amax() for s in shards.values()]).amax())
        assert ours.view(torch.int32) == shared.view(torch.int32), f"{group}: weight_scale_2 {ours} vs ModelOpt {shared}"
        for name, shard in shards.items():
            inputs[f"fused-{group}-{name}-shared-ws2"] = (shard, shared)
    small = groups["qkv"]["v-small"].float()
    ideal = small.view(small.shape[0], -1, 16).abs().amax(-1) / (6 * inputs["fused-qkv-v-small-shared-ws2"][1])
    scale_bytes = F.quantize_modelopt(small, inputs["fused-qkv-v-small-shared-ws2"][1]).block_scale.view(torch.uint8)
    below = ideal < 2.0**-10  # plain rounding would give 0 here
    assert int(below.sum()) > 20 and bool((scale_bytes[below] == 0x01).all()) and int((scale_bytes >= 0x08).sum()) > 20
    return inputs


def test_modelopt_all_zero_tensor_divergence_is_as_documented():
    """An all-zero tensor (weight_scale_2 = 0): ModelOpt computes 0/0 and writes NaN scale bytes and code 7; the
    reference writes ModelOpt's zero-block scale 1.0 (0x38) and code 0 (docs/format.md). With any positive
    weight_scale_2 the two agree (covered above)."""
    _modelopt_or_skip()
    x = torch.zeros(4, 32, dtype=torch.bfloat16)
    packed, scale_bytes, ws2 = O.modelopt_package_quantize(x)
    assert float(ws2) == 0.0
    assert set(scale_bytes.reshape(-1).tolist()) <= {0x7F, 0xFF}, "ModelOpt no longer writes NaN scales here"
    assert set(packed.reshape(-1).tolist()) == {0x77}
    ours = F.quantize_modelopt(x)
    assert set(ours.block_scale.view(torch.uint8).reshape(-1).tolist()) == {0x38}
    assert set(ours.packed.reshape(-1).tolist()) == {0} and bool((ours.dequantize() == 0).all())


def test_modelopt_tie_family_separates_the_division_orders():
    """The scale-tie family reaches its corner: ModelOpt's ``amax / (6 * ws2)`` and the other order
    ``(amax / 6) / ws2`` give different E4M3 bytes on a good share of its blocks (so 0 differing bytes above
    really pins the order)."""
    x = I.ADVERSARIAL_FAMILIES["modelopt-scale-ties"]()
    ws2 = F.decode_scale_from_amax(x.abs().amax())
    block_amax = x.view(x.shape[0], -1, 16).abs().amax(-1)
    other_order = F.e4m3_encode(block_amax / 6.0 / ws2).view(torch.uint8)
    ours = F.quantize_modelopt(x).block_scale.view(torch.uint8)
    exact_ties = torch.isin(block_amax.double() * 448.0 / float(x.abs().amax()),
                            torch.tensor([(a + b) / 2 for a, b in zip(O.E4M3_VALUES[8:126], O.E4M3_VALUES[9:127])],
                                         dtype=torch.float64))
    assert int(exact_ties.sum()) >= 200
    assert int((other_order != ours).sum()) >= 30

