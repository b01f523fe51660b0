"""Self-tests of the FlashInfer emulator: its results are the suite's reference for every backend tag
and layout, its W4A4 quantizer is FlashInfer's CPU model bit for bit, and its module tree stands in for
``flashinfer`` and is removed again."""
from __future__ import annotations

import sys

import pytest
import torch

import reference_impl.flashinfer_emulator as fe
from conformance.engine_harness.emulator_cases import moe_inputs, moe_wrapper, emulator_api
from conformance.interfaces.standin import AttrPatch, StandIn
from reference_impl.dense import w4a16_linear
from reference_impl.moe import fused_moe_w4a16
from reference_impl.format.nvfp4 import from_cutedsl_w13, quantize_modelopt, swizzle_128x4, unswizzle_128x4
from conformance.interfaces.kernel import MoEExperts

SHAPES = [(3, 192, 96), (1, 128, 64), (17, 64, 256)]  # (M, N, K): N below/at/above a 128-row tile


def _dense_problem(m, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = quantize_modelopt(torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g).bfloat16()
    return q, x, swizzle_128x4(q.block_scale)


@pytest.mark.parametrize("backend_tag", ["cudnn", "cute-dsl", "blackwell-native", "blackwell-tiled"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_dense_backends_equal_reference(backend_tag, m, n, k):
    backend = backend_tag
    """Every backend tag, prepared then run, gives exactly the reference W4A16 linear."""
    if backend == "blackwell-tiled" and n % 64:
        pytest.skip("blackwell-tiled needs N % 64 == 0 (FlashInfer's own rule)")
    q, x, sw = _dense_problem(m, n, k)
    alpha = q.weight_scale_2.reshape(1)
    b, sf, a = fe.prepare_bf16_fp4_weights(q.packed, sw, alpha, backend=backend)
    got = fe.mm_bf16_fp4(x, b, sf, a, backend=backend)
    assert torch.equal(got, w4a16_linear(x, q.packed, q.block_scale, alpha))


def test_cute_dsl_prepared_scales_are_a_view_of_the_swizzled_bytes():
    """The SM100 cute-dsl preparation is a strided view: no copy, same bytes (FlashInfer's contract)."""
    q, _, sw = _dense_problem(1, 192, 96)
    _, sf, _ = fe.prepare_bf16_fp4_weights(q.packed, sw, None, backend="cute-dsl")
    assert sf.data_ptr() == sw.data_ptr() and sf.dim() == 6
    assert torch.equal(fe.convert_sf_from_mma_layout(sf, 192, 96).view(torch.uint8), sw.view(torch.uint8))


def test_alpha_none_means_one_and_out_is_written():
    q, x, sw = _dense_problem(4, 128, 64)
    b, sf, _ = fe.prepare_bf16_fp4_weights(q.packed, sw, None, backend="cudnn")
    out = torch.empty(4, 128, dtype=torch.bfloat16)
    got = fe.mm_bf16_fp4(x, b, sf, None, backend="cudnn", out=out)
    assert got is out and torch.equal(out, w4a16_linear(x, q.packed, q.block_scale, torch.ones(1)))


def test_emulated_capability_changes_backend_support():
    q, x, sw = _dense_problem(2, 128, 64)
    b, sf, a = fe.prepare_bf16_fp4_weights(q.packed, sw, q.weight_scale_2.reshape(1), backend="cudnn")
    with fe.emulated_capability(90):
        with pytest.raises(fe.BackendSupportedError, match="capability 90"):
            fe.mm_bf16_fp4(x, b, sf, a, backend="cudnn")


def test_moe_wrapper_equals_reference_moe():
    """Checkpoint experts laid out as the kernel wants them ([up; gate] in 64-row groups, MMA-layout scales,
    one alpha per expert) give the reference fused MoE of the same experts."""
    api = emulator_api()
    inputs = moe_inputs(api, "cpu", t=6)
    wrapper = moe_wrapper(api, "cpu")
    got = wrapper.run(**inputs)
    e = inputs["w1_weight"].shape[0]
    scales13 = fe.convert_sf_from_mma_layout(inputs["w1_weight_sf"], 256, 128, e)
    lin13 = unswizzle_128x4(scales13.view(torch.uint8).reshape(e, 256, 8), 256, 8)
    lin2 = unswizzle_128x4(fe.convert_sf_from_mma_layout(inputs["w2_weight_sf"], 128, 128, e).view(torch.uint8).reshape(e, 128, 8), 128, 8)
    experts = MoEExperts(
        w13=from_cutedsl_w13(inputs["w1_weight"]), w13_scale=from_cutedsl_w13(lin13).view(torch.float8_e4m3fn),
        w13_scale_2=inputs["w1_alpha"].reshape(-1, 1).repeat(1, 2), w2=inputs["w2_weight"],
        w2_scale=lin2.view(torch.float8_e4m3fn), w2_scale_2=inputs["w2_alpha"],
    )
    want = fused_moe_w4a16(inputs["x"], inputs["token_selected_experts"], inputs["token_final_scales"], experts)
    assert torch.equal(got, want)


def test_moe_tokens_routed_to_other_ranks_contribute_nothing():
    api = emulator_api()
    inputs = moe_inputs(api, "cpu", t=4)
    wrapper = moe_wrapper(api, "cpu", num_experts=4, num_local_experts=2, local_expert_offset=2)
    inputs["token_selected_experts"] = torch.tensor([[0, 1]] * 4, dtype=torch.int32)  # rank 0's experts
    assert torch.count_nonzero(wrapper.run(**inputs)) == 0


def test_fp4_quantize_is_flashinfers_cpu_model():
    """The W4A4 activation quantizer matches FlashInfer's own CPU model bit for bit (swizzled scales)."""
    ref = pytest.importorskip("flashinfer.batch_invariant.quantization.nvfp4_reference")
    x = (torch.randn(33, 128, generator=torch.Generator().manual_seed(3)) * 3).bfloat16()
    gs = 448 * 6 / float(x.float().abs().max())
    packed, sf = fe.fp4_quantize(x, torch.tensor([gs]))
    want_packed, want_sf, _ = ref.quantize_reference(x, gs)
    assert torch.equal(packed, want_packed) and torch.equal(sf.view(torch.uint8), want_sf)


def test_mm_fp4_matches_dequantized_product():
    """W4A4: (dequant(a) @ dequant(b)^T) * alpha with both operands' 128x4 scales and b as weight.T."""
    q, x, sw = _dense_problem(5, 128, 64)
    gs = torch.tensor([2.0])
    xq, xs = fe.fp4_quantize(x, gs)
    got = fe.mm_fp4(xq, q.packed.T, xs, sw.T, torch.tensor([0.5]), torch.bfloat16, backend="cutlass")
    from reference_impl.format.nvfp4 import dequantize, quantize_kernel

    pk, ls = quantize_kernel(x, gs)
    want = (dequantize(pk, ls, 1.0) @ dequantize(q.packed, q.block_scale, 1.0).T * 0.5).bfloat16()
    assert torch.equal(got, want)


def test_standin_replaces_and_restores_flashinfer():
    import types

    target = types.SimpleNamespace(bound=object())
    before = {k: v for k, v in sys.modules.items() if k.startswith("flashinfer")}
    sentinel = object()
    with StandIn(fe.flashinfer_module_tree(), [AttrPatch(target, "bound", sentinel)], {"NVFP4_HARNESS_TEST": "1"}):
        import flashinfer
        from flashinfer import mm_bf16_fp4
        from flashinfer.cute_dsl.utils import convert_sf_to_mma_layout

        assert mm_bf16_fp4 is fe.mm_bf16_fp4 and convert_sf_to_mma_layout is fe.convert_sf_to_mma_layout
        assert flashinfer.__version__ == "0.7.4" and target.bound is sentinel
        with pytest.raises(ImportError):
            from flashinfer import trtllm_fp4_block_scale_moe  # noqa: F401  (not emulated)
    after = {k: v for k, v in sys.modules.items() if k.startswith("flashinfer")}
    assert after == before and target.bound is not sentinel
    import os

    assert "NVFP4_HARNESS_TEST" not in os.environ


def test_standin_owns_the_engine_contexts():
    """A subclass's engine_contexts are entered after the patches and exited first, in reverse order; one that
    fails while entering undoes those entered before it and the stand-in itself."""
    import contextlib
    import types

    target = types.SimpleNamespace(bound="original")
    log = []

    @contextlib.contextmanager
    def context(name, fail=False):
        log.append(f"enter {name} (bound={target.bound})")
        if fail:
            raise RuntimeError(name)
        try:
            yield
        finally:
            log.append(f"exit {name}")

    class EngineStandIn(StandIn):
        fail = False

        def engine_contexts(self):
            yield context("a")
            yield context("b", fail=self.fail)

    with EngineStandIn(fe.flashinfer_module_tree(), [AttrPatch(target, "bound", "patched")]):
        assert target.bound == "patched"
    assert log == ["enter a (bound=patched)", "enter b (bound=patched)", "exit b", "exit a"]
    assert target.bound == "original"
    log.clear()
    failing = EngineStandIn(fe.flashinfer_module_tree(), [AttrPatch(target, "bound", "patched")])
    failing.fail = True
    with pytest.raises(RuntimeError, match="b"):
        with failing:
            pass
    assert log == ["enter a (bound=patched)", "enter b (bound=patched)", "exit a"]
    assert target.bound == "original" and not failing.active
