"""The FlashInfer emulator as a conformance subject (``b200`` tier): on the same inputs, the emulator and
the real FlashInfer must (1) both be within the derived dense / MoE error bounds of the exact value and
(2) reject the same bad inputs with the same exception type. Run on a B200/B300:

    pytest conformance/engine_harness/test_emulator_vs_flashinfer.py -v

Their subject is real FlashInfer compared with the emulator, so under ``--flashinfer-emulated`` (where the
emulator stands in for FlashInfer) they skip with that reason instead of comparing the emulator with itself.
"""
from __future__ import annotations

import re

import pytest
import torch

import reference_impl.flashinfer_emulator as fe
from reference_impl.bounds.dense import dense_error_bound, error_figures
from conformance._framework.cases import as_params
from conformance._framework.selection import flashinfer_platform
from conformance.engine_harness.emulator_cases import BAD_INPUT_CASES, BadInputCase, emulator_api, flashinfer_api
from conformance.engine_harness.cases import EngineMoECase, build_moe_checkpoint, build_moe_inputs
from reference_impl.dense import w4a16_linear_exact
from reference_impl.format.nvfp4 import quantize_modelopt, swizzle_128x4, to_cutedsl_w13

pytestmark = pytest.mark.needs_real_flashinfer
_B200 = [pytest.mark.b200]
#: Messages FlashInfer gives when a source-built backend cannot be compiled on this machine (an environment
#: fact, not a conformance matter). cuDNN and the CuTe DSL are gated before the call, as FlashInfer's tests do.
_UNAVAILABLE = re.compile(r"JIT|nvcc|compile", re.IGNORECASE)


def _real_api():
    try:
        return flashinfer_api()
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"[b200] FlashInfer with the W4A16 API (>= 0.6.18) is not importable: {exc}")


@pytest.mark.parametrize("case", as_params([c for c in BAD_INPUT_CASES], extra_marks=_B200))
def test_bad_input_raises_like_the_emulator(case: BadInputCase):
    if not case.real_raises:
        pytest.skip(f"emulator-only check ({case.source}): the real kernel reads out of bounds here")
    api = _real_api()
    with pytest.raises(Exception) as real:
        case.call(api, torch.device("cuda"))
    case.expect.check(real.value)
    with pytest.raises(Exception) as emulated:
        case.call(emulator_api(), torch.device("cuda"))
    assert type(emulated.value).__name__ == type(real.value).__name__, (
        f"FlashInfer raised {type(real.value).__name__}: {real.value}; emulator {type(emulated.value).__name__}: {emulated.value}"
    )


DENSE_SHAPES = [(1, 256, 128), (7, 192, 256), (33, 4096, 4096), (128, 1024, 512)]


@pytest.mark.b200
@pytest.mark.parametrize("backend_tag", ["cute-dsl", "cudnn", "blackwell-native", "blackwell-tiled"])
@pytest.mark.parametrize("m,n,k", DENSE_SHAPES)
def test_dense_agrees_within_bound(backend_tag, m, n, k):
    api = _real_api()
    reason = flashinfer_platform(installed=True).gemm_skip_reason(backend_tag, "cuda")
    if reason:
        pytest.skip(reason)
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n + k)
    q = quantize_modelopt(torch.randn(n, k, device="cuda", generator=g))
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    sw, alpha = swizzle_128x4(q.block_scale), q.weight_scale_2.reshape(1).float()
    emu = fe.mm_bf16_fp4(x, *fe.prepare_bf16_fp4_weights(q.packed, sw, alpha, backend=backend_tag), backend=backend_tag)
    try:
        prepared = api.prepare_bf16_fp4_weights(q.packed, sw, alpha, backend=backend_tag)
        real = api.mm_bf16_fp4(x, *prepared, backend=backend_tag)
    except Exception as exc:  # a missing library is an environment fact; anything else fails
        if _UNAVAILABLE.search(str(exc)):
            pytest.skip(f"FlashInfer backend {backend_tag} unavailable here: {exc}")
        raise
    exact, mag = w4a16_linear_exact(x, q.packed, q.block_scale, alpha)
    bound = dense_error_bound(exact, mag, k, has_pre_quant_scale=False, bias=None)
    for name, y in (("flashinfer", real), ("emulator", emu)):
        fig = error_figures(y, exact, bound)
        assert fig.bound_ratio <= 1.0, f"{name} {backend_tag} outside the dense bound: ratio {fig.bound_ratio:.4g}"


MOE_CASES = [
    EngineMoECase("b200-moe-8-experts", num_experts=8, hidden=256, intermediate=256, tokens=64, top_k=2),
    EngineMoECase("b200-moe-ep-rank1", num_experts=8, hidden=256, intermediate=128, tokens=33, top_k=4, ep_size=2, ep_rank=1),
    EngineMoECase("b200-moe-1-token", num_experts=4, hidden=512, intermediate=256, tokens=1, top_k=2),
]


#: Routing inputs engines send besides router output (docs/moe.md): the emulator's reading of the contract
#: (duplicates count per slot; -1 skipped, its NaN weight never read) is checked against the real kernel here.
MOE_ROUTINGS = ("topk", "duplicate_ids", "padding_ids")


@pytest.mark.b200
@pytest.mark.parametrize("routing", MOE_ROUTINGS)
@pytest.mark.parametrize("case", MOE_CASES, ids=[c.id for c in MOE_CASES])
def test_moe_agrees_within_bound(case: EngineMoECase, routing: str):
    from reference_impl.bounds.moe import moe_error_bound
    from reference_impl.moe.routing import duplicate_slots, padding_slots

    api = _real_api()
    reason = flashinfer_platform(installed=True).moe_skip_reason("cuda")
    if reason:
        pytest.skip(reason)
    experts = build_moe_checkpoint(case).local_experts()
    x, ids, wts = build_moe_inputs(case)
    if routing != "topk":
        g = torch.Generator().manual_seed(case.seed + 2)
        ids, wts = (duplicate_slots if routing == "duplicate_ids" else padding_slots)(ids, wts, g)
    x, ids, wts = x.cuda(), ids.cuda(), wts.cuda()
    e = experts.num_local_experts
    dev = lambda t: t.cuda()  # noqa: E731
    w1 = dev(to_cutedsl_w13(experts.w13))
    sf1 = swizzle_128x4(to_cutedsl_w13(experts.w13_scale.view(torch.uint8))).cuda().reshape(-1)
    sf2 = swizzle_128x4(experts.w2_scale.view(torch.uint8)).cuda().reshape(-1)
    args = dict(x_sf=None, token_selected_experts=ids, token_final_scales=wts, w1_weight=w1,
                w1_alpha=dev(experts.w13_scale_2[:, 0].contiguous()), fc2_input_scale=None,
                w2_weight=dev(experts.w2), w2_alpha=dev(experts.w2_scale_2))
    outs = {}
    for name, mod in (("flashinfer", api), ("emulator", emulator_api())):
        wrapper = mod.CuteDslMoEWrapper(num_experts=case.num_experts, top_k=case.top_k, hidden_size=case.hidden,
                                        intermediate_size=case.intermediate, num_local_experts=e,
                                        local_expert_offset=case.ep_rank * e, quant_mode="w4a16", device="cuda")
        outs[name] = wrapper.run(x=x, w1_weight_sf=mod.convert_sf_to_mma_layout(sf1, m=2 * case.intermediate, k=case.hidden, num_groups=e),
                                 w2_weight_sf=mod.convert_sf_to_mma_layout(sf2, m=case.hidden, k=case.intermediate, num_groups=e), **args)
    b = moe_error_bound(x, ids, wts, experts.__class__(**{**experts.__dict__, **{k: getattr(experts, k).cuda() for k in ("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2")}}))
    for name, y in outs.items():
        fig = error_figures(y, b.exact, b.bound)
        assert fig.bound_ratio <= 1.0, f"{name} MoE outside the bound: ratio {fig.bound_ratio:.4g}"
