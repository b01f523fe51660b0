"""Self-tests of the MoE reference (:mod:`reference_impl.moe`, :mod:`reference_impl.moe.routing`,
:mod:`reference_impl.format.online_quant`), its error bound (:mod:`reference_impl.bounds.moe`) and the FlashInfer
MoE layout code (:mod:`conformance.adapters.flashinfer.moe`), independent of any backend."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import reference_impl.moe as moe
from conformance.interfaces.kernel import CaseInfo
from conformance.adapters.flashinfer import moe as fim
from reference_impl.bounds.moe import (
    L_GELU,
    L_SILU,
    moe_error_bound,
    quantization_error_bound,
    recipe_independent_error_bound,
    weight_perturbation_bound,
)
from conformance.moe.cases import MOE_CASES, MoECase, build_global_experts, build_inputs, rank_slice
from reference_impl.format.nvfp4 import dequantize, quantize_kernel, quantize_modelopt
from reference_impl.format.online_quant import (
    dequantize_experts,
    online_weight_scale_2,
    quantize_4over6,
    quantize_experts_online,
)
from reference_impl.moe.routing import route_all_to_one, sigmoid_topk_with_bias, softmax_topk

CASES = {c.id: c for c in MOE_CASES}
SMALL = MoECase("self_t33_e8_k2", "cpu", 33, 8, 2, 128, 64)


# ----------------------------------------------------------------------------------------- routing
def test_softmax_topk_matches_naive_loop() -> None:
    logits = torch.randn(9, 12, generator=torch.Generator().manual_seed(0))
    for renorm in (True, False):
        ids, w = softmax_topk(logits, 3, renormalize=renorm)
        assert ids.dtype == torch.int32 and w.dtype == torch.float32
        for t in range(9):
            p = [math.exp(v) for v in logits[t].tolist()]
            p = [v / sum(p) for v in p]
            top = sorted(range(12), key=lambda e: -p[e])[:3]
            assert ids[t].tolist() == top
            expect = [p[e] / (sum(p[i] for i in top) if renorm else 1.0) for e in top]
            assert w[t].tolist() == pytest.approx(expect, rel=1e-6)


def test_sigmoid_bias_chooses_with_bias_and_weighs_without() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0])  # expert 0 wins the choice despite the lowest score
    ids, w = sigmoid_topk_with_bias(logits, bias, 2, renormalize=False, routed_scaling_factor=2.0)
    assert ids.tolist() == [[0, 3]]
    assert w[0].tolist() == pytest.approx([2 * 0.5, 2 * 1 / (1 + math.exp(-3))])
    _, wn = sigmoid_topk_with_bias(logits, bias, 2, renormalize=True)
    assert float(wn.sum()) == pytest.approx(1.0)


def test_routing_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="top_k"):
        softmax_topk(torch.zeros(2, 4), 5)
    with pytest.raises(ValueError, match="correction bias"):
        sigmoid_topk_with_bias(torch.zeros(2, 4), torch.zeros(3), 2)
    ids, _ = route_all_to_one(3, 2, 7, 8)
    assert ids.tolist() == [[7, 0]] * 3


# ----------------------------------------------------------------------------------------- activations
def test_activations_match_independent_formulas() -> None:
    g = torch.linspace(-12, 12, 401, dtype=torch.float64)
    u = torch.linspace(9, -9, 401, dtype=torch.float64)
    assert torch.allclose(moe.apply_activation("swiglu", g, u), torch.nn.functional.silu(g) * u)
    assert torch.allclose(moe.apply_activation("geglu", g, u), torch.nn.functional.gelu(g, approximate="tanh") * u)
    assert torch.equal(moe.apply_activation("relu2", g, None), torch.clamp(g, min=0) ** 2)
    oai = moe.apply_activation("swiglu_oai", g, u, {"alpha": 1.702, "beta": 1.0, "limit": 7.0})
    gc, uc = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
    assert torch.allclose(oai, gc * torch.sigmoid(1.702 * gc) * (uc + 1.0))
    # the clamp is active: values beyond the limit behave as the limit
    big = moe.apply_activation("swiglu_oai", torch.tensor([50.0]), torch.tensor([50.0]))
    assert big.item() == pytest.approx(7.0 * torch.sigmoid(torch.tensor(1.702 * 7.0)).item() * 8.0)
    with pytest.raises(ValueError, match="unknown MoE activation"):
        moe.is_gated("gelu")


def test_lipschitz_constants_cover_the_derivatives() -> None:
    x = torch.linspace(-30, 30, 600001, dtype=torch.float64, requires_grad=True)
    (ds,) = torch.autograd.grad(torch.nn.functional.silu(x).sum(), x)
    (dg,) = torch.autograd.grad(moe.gelu_tanh(x).sum(), x)
    assert ds.abs().max() < L_SILU and dg.abs().max() < L_GELU


# ----------------------------------------------------------------------------------------- the MoE
def _naive_moe(x, ids, w, experts) -> torch.Tensor:
    """Token by token, slot by slot, from fully dequantized weights (fp64)."""
    off = moe.local_expert_offset(experts)
    gated = moe.is_gated(experts.activation)
    y = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k]) - off
            if not 0 <= e < experts.num_local_experts:
                continue
            w13 = dequantize(experts.w13[e], experts.w13_scale[e], 1.0, torch.float64)
            s = experts.w13_scale_2[e].double()
            v = w13 @ x[t].double()
            half = v.shape[0] // 2
            h = moe.apply_activation(experts.activation, v[:half] * s[0], v[half:] * s[1], experts.activation_params) \
                if gated else moe.apply_activation("relu2", v * s[0], None)
            w2 = dequantize(experts.w2[e], experts.w2_scale[e], 1.0, torch.float64)  # scale in fp64 below
            y[t] += float(w[t, k]) * (w2 @ h) * float(experts.w2_scale_2[e])
    return y


@pytest.mark.parametrize("case_id", ["t7_e8_k2_h192_i192", "t128_e8_k2_relu2", "t128_e8_k2_gate_up_general"])
def test_exact_moe_matches_naive_loop(case_id) -> None:
    case = replace(CASES[case_id], tokens=5)
    experts = build_global_experts(case)
    x, ids, w = build_inputs(case)
    exact = moe.fused_moe_exact(x, ids, w, experts)
    assert torch.allclose(exact, _naive_moe(x, ids, w, experts), rtol=1e-12, atol=1e-12)


def test_fp32_reference_within_bound_and_bf16_intermediate_matters() -> None:
    experts = build_global_experts(SMALL)
    x, ids, w = build_inputs(SMALL)
    ref = moe_error_bound(x, ids, w, experts)
    y = moe.fused_moe_w4a16(x, ids, w, experts)
    assert ((y.double() - ref.exact).abs() <= ref.bound).all()
    y_no_round = moe.fused_moe_w4a16(x, ids, w, experts, round_intermediate=False)
    assert not torch.equal(y, y_no_round)  # the bf16 intermediate is a real choice, not a no-op


def test_expert_parallel_ranks_sum_to_full_layer() -> None:
    case = CASES["t128_e64_k8_ep4"]
    full = build_global_experts(case)
    x, ids, w = build_inputs(case)
    exact_full = moe.fused_moe_exact(x, ids, w, full)
    ranks = [rank_slice(full, r, 4) for r in range(4)]
    total = sum(moe.fused_moe_exact(x, ids, w, r) for r in ranks)
    assert torch.allclose(total, exact_full, rtol=1e-12, atol=1e-12)
    # a token routed only to rank 0's experts contributes nothing on the other ranks
    only0 = torch.zeros_like(ids)
    assert moe.fused_moe_exact(x, only0, w, ranks[1]).abs().max() == 0
    fp32_total = sum(moe.fused_moe_w4a16(x, ids, w, r).double() for r in ranks)
    bound = sum(moe_error_bound(x, ids, w, r).bound for r in ranks)
    assert ((fp32_total - exact_full).abs() <= bound).all()


def test_only_experts_with_tokens_are_dequantized(monkeypatch) -> None:
    import reference_impl.moe.grouped as grouped

    case = CASES["t128_e64_k2_empty_experts"]
    experts = build_global_experts(case)
    x, ids, w = build_inputs(case)
    seen = []
    real = grouped.prepare_experts
    monkeypatch.setattr(grouped, "prepare_experts", lambda ex, local=None: seen.extend(local) or real(ex, local))
    moe.fused_moe_w4a16(x, ids, w, experts)
    assert sorted(seen) == sorted(set(ids.reshape(-1).tolist())) and all(e % 4 == 0 for e in seen)
    assert moe.fused_moe_exact(x, ids, w, experts).shape == x.shape  # the fp64 path decodes per expert


def test_order_and_grouping_do_not_matter_beyond_rounding() -> None:
    experts = build_global_experts(SMALL)
    x, ids, w = build_inputs(SMALL)
    a = moe.fused_moe_exact(x, ids, w, experts)
    b = moe.fused_moe_w4a16(x, ids, w, experts, accum_dtype=torch.float64, out_dtype=torch.float64,
                            expert_order=list(range(8))[::-1])
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1))
    c = moe.fused_moe_exact(x[perm], ids[perm], w[perm], experts)
    assert torch.allclose(a[perm], c, rtol=1e-12, atol=1e-12)


def test_out_of_range_and_negative_ids_contribute_nothing() -> None:
    experts = build_global_experts(SMALL)
    x, ids, w = build_inputs(SMALL)
    masked = ids.clone()
    masked[:, 1] = -1
    masked[0, 0] = 99
    y = moe.fused_moe_exact(x, masked, w, experts)
    keep = ids.clone()
    keep_w = w.clone()
    keep_w[:, 1] = 0
    keep_w[0, 0] = 0
    assert torch.allclose(y, moe.fused_moe_exact(x, keep, keep_w, experts), rtol=1e-12, atol=1e-12)


def test_input_scales_are_never_read() -> None:
    experts = build_global_experts(SMALL)
    x, ids, w = build_inputs(SMALL)
    a = moe.fused_moe_w4a16(x, ids, w, experts)
    b = moe.fused_moe_w4a16(x, ids, w, replace(experts, w13_input_scale=torch.full((8, 2), 1e9), w2_input_scale=None))
    assert torch.equal(a, b)


def test_bad_inputs_raise_clear_errors() -> None:
    experts = build_global_experts(SMALL)
    x, ids, w = build_inputs(SMALL)
    with pytest.raises(TypeError, match="bfloat16"):
        moe.fused_moe_w4a16(x.float(), ids, w, experts)
    with pytest.raises(ValueError, match="topk_weights shape"):
        moe.fused_moe_w4a16(x, ids, w[:, :1], experts)
    with pytest.raises(ValueError, match="hidden size"):
        moe.fused_moe_w4a16(x[:, :64], ids, w, experts)
    with pytest.raises(ValueError, match="halves"):
        moe.fused_moe_w4a16(x, ids, w, replace(experts, activation="relu2"))
    with pytest.raises(TypeError, match="integer"):
        moe.fused_moe_w4a16(x, ids.float(), w, experts)


# ----------------------------------------------------------------------------------------- bound
def test_bound_is_a_small_fraction_of_the_output() -> None:
    """Sanity of scale: the bound stays well below the output magnitude (a gross error cannot hide), and
    above the real rounding error (~2e-3 relative)."""
    experts = build_global_experts(SMALL)
    x, ids, w = build_inputs(SMALL)
    ref = moe_error_bound(x, ids, w, experts)
    rel = (ref.bound / ref.exact.abs().clamp_min(1e-30)).median()
    assert 4e-3 < rel < 0.1, f"median bound/|y| = {rel}"


# ----------------------------------------------------------------------------------------- online quantization
def _hp_experts(e=4, i=64, h=128, seed=3):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.05).bfloat16()
    w2 = (torch.randn(e, h, i, generator=g) * 0.05).bfloat16()
    return w13, w2


def test_online_modelopt_recipe_equals_reference_recipe_with_shared_gate_up_scale() -> None:
    w13, w2 = _hp_experts()
    q = quantize_experts_online(w13, w2, recipe="modelopt")
    for e in range(4):
        ref = quantize_modelopt(w13[e], online_weight_scale_2(w13[e]))
        assert torch.equal(q.w13[e], ref.packed) and torch.equal(q.w13_scale[e].view(torch.uint8), ref.block_scale.view(torch.uint8))
        assert q.w13_scale_2[e, 0] == q.w13_scale_2[e, 1] == w13[e].float().abs().max() / 2688
    assert online_weight_scale_2(torch.zeros(4, 16)) == 1.0


@pytest.mark.parametrize("recipe", ["modelopt", "kernel", "4over6"])
def test_every_recipe_is_within_the_quantization_error_bound(recipe) -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 256, generator=g) * torch.logspace(-3, 1, 256).unsqueeze(0)  # wide dynamic range
    w[3] = 0
    ws2 = online_weight_scale_2(w)
    if recipe == "kernel":
        packed, sf = quantize_kernel(w, 1.0 / ws2)
    else:
        q = quantize_4over6(w, ws2) if recipe == "4over6" else quantize_modelopt(w, ws2)
        packed, sf = q.packed, q.block_scale
    deq = dequantize(packed, sf, ws2, torch.float64)
    err = (deq - w.double()).abs()
    assert (err <= quantization_error_bound(w, sf.float().double() * ws2.double())).all()  # at its own scale
    assert (err <= recipe_independent_error_bound(w)).all()  # from w alone


def test_4over6_picks_the_smaller_error_and_differs_from_modelopt_on_some_blocks() -> None:
    w13, _ = _hp_experts()
    w = w13[0].float()
    ws2 = online_weight_scale_2(w)
    a, b = quantize_4over6(w, ws2), quantize_modelopt(w, ws2)
    err = lambda q: (dequantize(q.packed, q.block_scale, ws2, torch.float64) - w.double()).square().reshape(-1, 16).sum(-1)  # noqa: E731
    assert (err(a) <= err(b) + 1e-30).all()
    differs = (a.block_scale.view(torch.uint8) != b.block_scale.view(torch.uint8)).float().mean()
    assert 0.05 < differs < 0.95, f"4over6 changed {differs:.0%} of the block scales"


@pytest.mark.parametrize("recipe", ["modelopt", "4over6"])
@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_online_quantized_moe_matches_bf16_model_within_derived_bound(recipe, activation) -> None:
    w13, w2 = _hp_experts()
    if activation == "relu2":
        w13 = w13[:, :64]
    q = quantize_experts_online(w13, w2, activation=activation, recipe=recipe)
    case = MoECase("online_probe", "cpu", 40, 4, 2, 128, 64, activation=activation)
    x, ids, w = build_inputs(case)
    ref = weight_perturbation_bound(x, ids, w, w13.double(), w2.double(), q)
    got = moe.fused_moe_exact(x, ids, w, q)
    err = (got - ref.exact).abs()
    assert (err <= ref.bound).all()
    assert err.max() > 0  # the quantization does change the output: the check compares two different models
    deq13, _ = dequantize_experts(q)
    assert deq13.shape == w13.shape


def test_wrong_decode_scale_fails_the_per_element_weight_bound() -> None:
    """A 25% wrong decode scale is caught where it is discriminating: element by element on the weights.
    (The MoE-level bound is a worst case through two GEMMs and would let it pass.)"""
    w13, _ = _hp_experts()
    q = quantize_modelopt(w13[0].float(), online_weight_scale_2(w13[0]))
    ws2 = q.weight_scale_2 * 1.25
    deq = dequantize(q.packed, q.block_scale, ws2, torch.float64)
    bound = quantization_error_bound(w13[0], q.block_scale.float().double() * ws2.double())
    assert ((deq - w13[0].double()).abs() > bound).any()


def test_weight_perturbation_bound_can_fail_on_the_encode_decode_mix_up() -> None:
    """The classic convention mix-up at the MoE level: FlashInfer's encode scale ``448 * 6 / amax`` stored
    where ModelOpt's decode scale belongs."""
    w13, w2 = _hp_experts()
    q = quantize_experts_online(w13, w2)
    wrong = replace(q, w13_scale_2=1.0 / q.w13_scale_2, w2_scale_2=1.0 / q.w2_scale_2)
    x, ids, w = build_inputs(MoECase("online_probe", "cpu", 40, 4, 2, 128, 64))
    ref = weight_perturbation_bound(x, ids, w, w13.double(), w2.double(), wrong)
    assert ((moe.fused_moe_exact(x, ids, w, wrong) - ref.exact).abs() > ref.bound).any()


# ----------------------------------------------------------------------------------------- FlashInfer layout
def test_kernel_layout_round_trip_and_interleave_order() -> None:
    experts = build_global_experts(CASES["t7_e8_k2_h192_i192"])
    layout = fim.build_kernel_layout(experts)
    i = 192
    # rows 0..63 of expert 0 are up[0:64], rows 64..127 gate[0:64]
    assert torch.equal(layout.w1[0, :64], experts.w13[0, i : i + 64])
    assert torch.equal(layout.w1[0, 64:128], experts.w13[0, :64])
    back = fim.read_back_kernel_layout(layout, experts)
    assert torch.equal(back.w13, experts.w13) and torch.equal(back.w2, experts.w2)
    assert torch.equal(back.w13_scale.view(torch.uint8), experts.w13_scale.view(torch.uint8))
    assert torch.equal(back.w2_scale.view(torch.uint8), experts.w2_scale.view(torch.uint8))
    assert torch.equal(layout.w1_alpha, experts.w13_scale_2[:, 0]) and layout.w1_alpha.dtype == torch.float32


def test_mma_view_matches_flashinfer_layout_function() -> None:
    from reference_impl.flashinfer_emulator import convert_sf_to_mma_layout

    experts = build_global_experts(CASES["t7_e8_k2_h192_i192"])
    layout = fim.build_kernel_layout(experts)
    from reference_impl.format.nvfp4 import swizzle_128x4, to_cutedsl_w13

    flat = swizzle_128x4(to_cutedsl_w13(experts.w13_scale).view(torch.uint8)).reshape(-1)
    theirs = convert_sf_to_mma_layout(flat, m=384, k=192, num_groups=8)
    assert theirs.shape == layout.w1_sf.shape and theirs.stride() == layout.w1_sf.stride()
    assert torch.equal(theirs, layout.w1_sf)


def test_gate_up_fold_is_exact_or_refused() -> None:
    pow2 = build_global_experts(CASES["t128_e8_k2_gate_up_pow2"])
    scales, alpha = fim.fold_gate_up_scales(pow2.w13_scale, pow2.w13_scale_2, gated=True)
    assert torch.equal(alpha, pow2.w13_scale_2[:, 1])  # up = 2 x gate: the larger one
    half = pow2.w13_scale.shape[1] // 2
    folded = scales[:, :half].float() * alpha[:, None, None]
    assert torch.equal(folded, pow2.w13_scale[:, :half].float() * pow2.w13_scale_2[:, :1, None])
    general = build_global_experts(CASES["t128_e8_k2_gate_up_general"])
    with pytest.raises(fim.GateUpFoldError, match="cannot be folded"):
        fim.fold_gate_up_scales(general.w13_scale, general.w13_scale_2, gated=True)


def test_flashinfer_moe_skip_reasons_on_this_machine() -> None:
    from conformance.adapters.flashinfer.platform import InstalledFlashInfer

    info = CASES["t128_e8_k2_ep2"].info()
    reason = fim.flashinfer_moe_skip_reason(info, platform=InstalledFlashInfer())
    assert reason and "CUDA GPUs only" in reason and "SM100" in reason
    odd = CaseInfo("moe", torch.device("cuda"), {"intermediate": 96}, frozenset({"swiglu"}))
    assert "intermediate % 64" in fim.flashinfer_moe_skip_reason(odd)
    with pytest.raises(RuntimeError, match="CUDA"):
        fim.prepare_moe(build_global_experts(SMALL), torch.device("cpu"), platform=InstalledFlashInfer())


@pytest.mark.parametrize("cap, expect", [((9, 0), "found SM90 (NVIDIA H200)"), ((10, 0), None), ((12, 0), "found SM120")])
def test_flashinfer_moe_capability_gate(cap, expect) -> None:
    """The capability branch, on CPU: a made-up GPU and the emulated wrapper, whose ``__init__`` carries
    FlashInfer's ``is_compute_capability_supported`` query like the real one."""
    from conformance.adapters.flashinfer.platform import InstalledFlashInfer
    from conformance.testing import Gpu
    from reference_impl import flashinfer_emulator as emu

    class Machine(InstalledFlashInfer):
        def gpu(self, device):
            return Gpu("NVIDIA H200", cap)

        def load(self):
            return emu, None

        def moe_wrapper(self):
            return emu.CuteDslMoEWrapper, emu.ActivationType

        def cute_dsl_problem(self, capability):
            return None

    info = CaseInfo("moe", torch.device("cuda"), {"intermediate": 128}, frozenset({"swiglu"}))
    reason = fim.flashinfer_moe_skip_reason(info, platform=Machine())
    assert reason is None if expect is None else expect in reason
