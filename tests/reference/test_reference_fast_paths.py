"""Self-tests of the BF16-dequant reference (:mod:`reference_impl.dense`, :mod:`reference_impl.moe.grouped`,
:func:`reference_impl.format.nvfp4.codes_times_block_scales`): the exact bf16 decode, the exact AWQ split, the
code paths CUDA takes (exercised on CPU through an emulated fp32-output GEMM), the grouped MoE's subsets,
orders and chunks, and the Triton grouped GEMM under Triton's CPU interpreter (when Triton is installed)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import reference_impl.dense as dense
import reference_impl.moe.grouped as grouped
import reference_impl.format.nvfp4 as nvfp4
from reference_impl.bounds.moe import moe_error_bound
from conformance.dense.checks import failing_checks
from conformance.dense.cases import CPU_CASES
from conformance.moe.cases import MOE_CASES, build_global_experts, build_inputs
from conformance.adapters.reference.kernel import ReferenceBackend
from reference_impl.moe import fused_moe_exact, fused_moe_w4a16

REPO = Path(__file__).resolve().parents[2]
MOE = {c.id: c for c in MOE_CASES}


# ----------------------------------------------------------------------------------------- decode
def test_bf16_decode_is_exact_for_every_byte_and_every_scale() -> None:
    """All 256 packed bytes (both nibbles, -0 included) times all 256 E4M3 bytes (normal, subnormal, zero,
    NaN): the bf16 decode equals e2m1 * e4m3 evaluated in fp64 from the format tables, bit for bit."""
    packed = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # [256 scales, 256 bytes] -> K = 512
    scales = torch.arange(256, dtype=torch.uint8).view(256, 1).expand(256, 32).contiguous()
    got = nvfp4.codes_times_block_scales(packed, scales.view(torch.float8_e4m3fn))
    assert got.dtype == torch.bfloat16 and got.shape == (256, 512)
    codes = nvfp4.unpack_nibbles(packed)
    want = nvfp4.e2m1_decode(codes, torch.float64) * nvfp4.e4m3_decode(scales).double().repeat_interleave(16, -1)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan) and int(nan.sum()) == 2 * 512  # scale bytes 0x7F and 0xFF
    assert torch.equal(got.double()[~nan], want[~nan])
    assert torch.equal(torch.signbit(got)[~nan], torch.signbit(want)[~nan])  # code 8 decodes to -0
    finite = want[~nan].abs()
    assert float(finite[finite > 0].min()) == 2.0**-10 and float(finite.max()) == 2688.0  # the stated range


def test_bf16_decode_in_chunks_with_expert_dims(monkeypatch) -> None:
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 40, 24), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 0x7F, (3, 40, 3), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    whole = nvfp4.codes_times_block_scales(packed, scales)
    monkeypatch.setattr(nvfp4, "DECODE_CHUNK_ELEMENTS", 100)  # 2 rows per step
    assert torch.equal(nvfp4.codes_times_block_scales(packed, scales), whole)
    assert torch.equal(nvfp4.dequantize(packed, scales, torch.tensor([0.5, 1.0, 2.0])),
                       whole.float() * torch.tensor([0.5, 1.0, 2.0]).view(3, 1, 1))
    with pytest.raises(ValueError, match="block scale shape"):
        nvfp4.codes_times_block_scales(packed, scales[:, :, :2])


# ----------------------------------------------------------------------------------------- dense
def test_awq_split_into_two_bf16_halves_is_exact() -> None:
    """``x' = x * pqs`` (bf16 x bf16, exact in fp32) equals ``hi + lo`` with both halves bf16, exactly, over
    the whole bf16 exponent range the cases can reach and every mantissa pattern."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(1 << 16, generator=g) * torch.exp2(torch.randint(-60, 60, (1 << 16,), generator=g).float())).bfloat16()
    pqs = torch.exp2(torch.rand(1 << 16, generator=g) * 8 - 4).bfloat16()
    scaled = x.float() * pqs.float()
    assert torch.equal(scaled.double(), x.double() * pqs.double())  # exact in fp32
    hi = scaled.to(torch.bfloat16)
    lo = (scaled - hi.float()).to(torch.bfloat16)
    assert torch.equal(hi.double() + lo.double(), scaled.double())


def _emulate_cuda_gemms(monkeypatch) -> None:
    """CPU stand-in for ``torch.addmm(..., out_dtype=torch.float32)``: the same fp32 sum of exact products."""
    real = torch.addmm

    def addmm(c, a, b, *, alpha=1, beta=1, out_dtype=None):
        if out_dtype is None:
            return real(c, a, b, alpha=alpha, beta=beta)
        assert out_dtype == torch.float32 and a.dtype == b.dtype == torch.bfloat16
        return real(c.float(), a.float(), b.float(), alpha=alpha, beta=beta)

    monkeypatch.setattr(torch, "addmm", addmm)
    monkeypatch.setattr(dense, "uses_cublas_fp32_gemm", lambda device: True)


@pytest.mark.parametrize("case", [c for c in CPU_CASES if c.awq or c.bias or len(c.shard_list) > 1
                                  or c.x_kind != "gaussian" or c.id == "cpu-m1000-n160-k256"], ids=lambda c: c.id)
def test_cuda_code_path_passes_every_check(monkeypatch, case) -> None:
    """The bf16-operand path (fp32-output GEMM, fused alpha/bias, AWQ as two exact bf16 halves) passes every
    dense check, on CPU through an emulated fp32-output GEMM."""
    _emulate_cuda_gemms(monkeypatch)
    assert failing_checks(ReferenceBackend(), case) == {}


def test_cpu_fallback_and_cuda_path_agree_to_fp32_rounding(monkeypatch) -> None:
    case = next(c for c in CPU_CASES if c.id == "cpu-awq-bias-3d")
    from conformance.dense.cases import build_activations, build_layer

    layer, x = build_layer(case), build_activations(case)
    args = (layer.weight, layer.weight_scale, layer.weight_scale_2, layer.pre_quant_scale, layer.bias)
    fallback = dense.w4a16_linear(x, *args, out_dtype=torch.float32)
    _emulate_cuda_gemms(monkeypatch)
    split = dense.w4a16_linear(x, *args, out_dtype=torch.float32)
    exact, magnitude = dense.w4a16_linear_exact(x, *args)
    # both are fp32 sums of exact products (K and 2K terms): within gamma_{2K+2}(2^-24) * A of the exact value
    k = case.k
    for y in (fallback, split):
        assert bool(((y.double() - exact).abs() <= (2 * k + 2) * 2.0**-24 * (magnitude + exact.abs()) + 1e-30).all())


def test_small_cpu_layers_keep_an_fp64_upcast_large_ones_do_not(monkeypatch) -> None:
    case = next(c for c in CPU_CASES if c.id == "cpu-bias")
    from conformance.dense.cases import build_layer

    layer = build_layer(case)
    small = dense.prepare_w4a16_linear(layer.weight, layer.weight_scale, layer.weight_scale_2, bias=layer.bias)
    assert small.weight.dtype == torch.bfloat16 and small.weight_fp64 is not None
    monkeypatch.setattr(dense, "_CHUNK_ELEMENTS", 1000)
    large = dense.prepare_w4a16_linear(layer.weight, layer.weight_scale, layer.weight_scale_2, bias=layer.bias)
    assert large.weight_fp64 is None
    x = torch.randn(5, case.k, generator=torch.Generator().manual_seed(5)).bfloat16()
    # The exact accumulator does not depend on how W is chunked (an fp32 BLAS GEMM did: a chunk is another GEMM
    # shape, whose K-sum order the BLAS may choose differently; 54 of 400 random inputs were not bitwise equal).
    assert torch.equal(dense.run_w4a16_linear(small, x), dense.run_w4a16_linear(large, x))
    exact, magnitude = dense.w4a16_linear_exact(x, layer.weight, layer.weight_scale, layer.weight_scale_2,
                                                bias=layer.bias)
    tol = (case.k + 2) * 2.0**-24 * (magnitude + exact.abs()) + 2.0**-8 * exact.abs() + 1e-30
    assert bool(((dense.run_w4a16_linear(small, x).double() - exact).abs() <= tol).all())


# ----------------------------------------------------------------------------------------- MoE
def test_moe_subsets_orders_and_chunks(monkeypatch) -> None:
    case = MOE["t128_e8_k2_gate_up_pow2"]
    experts = build_global_experts(case)
    x, ids, w = build_inputs(case)
    full = grouped.run_prepared_experts(grouped.prepare_experts(experts), x, ids, w)
    reordered = grouped.prepare_experts(experts, list(range(8))[::-1])
    assert reordered.partial and torch.equal(grouped.run_prepared_experts(reordered, x, ids, w), full)
    assert torch.equal(fused_moe_w4a16(x, ids, w, experts), full)  # the one-shot form decodes a subset
    used = sorted(set(ids.reshape(-1).tolist()))
    with pytest.raises(ValueError, match="not prepared"):
        grouped.run_prepared_experts(grouped.prepare_experts(experts, used[:-1]), x, ids, w)
    with pytest.raises(ValueError, match="distinct"):
        grouped.prepare_experts(experts, [0, 0])
    monkeypatch.setattr(grouped, "MOE_CHUNK_BYTES", 2 * 256 * 4 * 7)  # 7 tokens per chunk
    chunked = grouped.run_prepared_experts(grouped.prepare_experts(experts), x, ids, w)
    ref = moe_error_bound(x, ids, w, experts)
    assert bool(((chunked.double() - ref.exact).abs() <= ref.bound).all())
    assert bool(((full.double() - ref.exact).abs() <= ref.bound).all())


def test_moe_no_local_tokens_and_fp32_intermediate() -> None:
    case = MOE["t7_e8_k2_h192_i192"]
    experts = build_global_experts(case)
    x, ids, w = build_inputs(case)
    assert fused_moe_w4a16(x, ids + 8, w, experts).abs().max() == 0  # every id belongs to another rank
    no_round = fused_moe_w4a16(x, ids, w, experts, round_intermediate=False, out_dtype=torch.float64)
    exact = fused_moe_exact(x, ids, w, experts)
    assert float((no_round - exact).abs().max()) < 1e-4 * float(exact.abs().max())


@pytest.mark.skipif(os.environ.get("NVFP4_SKIP_TRITON_INTERPRETER") == "1", reason="disabled by environment")
def test_triton_grouped_gemm_under_the_interpreter() -> None:
    """The CUDA grouped GEMM's indexing (segments, gathered A rows, scattered output rows, column split of
    the decode scales, row scales) against a plain loop, run by Triton's CPU interpreter. The interpreter
    has no bf16 dot, so operands are fp32 here; the GPU run is covered by the cuda tier."""
    pytest.importorskip("triton", reason="Triton not installed (it ships with CUDA torch builds)")
    script = textwrap.dedent('''
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        import numpy as np
        import torch
        import triton.runtime.interpreter as ti
        _patch = ti._patch_lang_tensor
        def patched(tensor, scope):  # Triton 3.6's interpreter calls int() on 1-element arrays (numpy >= 2.4 refuses)
            _patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
        ti._patch_lang_tensor = patched
        from reference_impl.moe import _triton_grouped_gemm as tg
        g = torch.Generator().manual_seed(0)
        E, N, K = 5, 96, 80
        w = torch.randn(E, N, K, generator=g)
        a = torch.randn(50, K, generator=g)
        counts = torch.tensor([7, 0, 20, 1, 9])
        seg = torch.cumsum(counts, 0) - counts
        rows = int(counts.sum())
        a_rows = torch.randint(0, 50, (rows,), generator=g)
        sa, sb, rs = torch.rand(E) + 0.5, torch.rand(E) + 0.5, torch.rand(rows)
        out_rows = torch.randperm(60, generator=g)[:rows]
        for config in [(16, 32, 32, 4, 1), (32, 64, 64, 4, 1)]:
            out = torch.full((60, N), float("nan"))
            tg.grouped_gemm(a, w, counts, seg, rows, sa, sb, 40, out, a_rows=a_rows, out_rows=out_rows,
                            row_scale=rs, config=config)
            want = torch.full((60, N), float("nan"), dtype=torch.float64)
            for e in range(E):
                s, c = int(seg[e]), int(counts[e])
                col = torch.where(torch.arange(N) < 40, sa[e], sb[e]).double()
                want[out_rows[s:s + c]] = (a[a_rows[s:s + c]].double() @ w[e].double().T) * col * rs[s:s + c, None].double()
            assert torch.equal(torch.isnan(out), torch.isnan(want)), config
            err = (out.double() - want).nan_to_num().abs().max().item()
            assert err <= 1e-5 * want.nan_to_num().abs().max().item(), (config, err)
        print("ok")
    ''')
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-3000:]


# ----------------------------------------------------------------------------------------- kept decodes
def test_moe_expert_cache_gives_the_same_bits_and_is_used() -> None:
    """fused_moe_w4a16's ``expert_cache``: the same output bit for bit as decoding at each call, the decoded
    experts kept after the first call and served from it later (a cache holding other values is used: this
    is what the caller must empty when the weights change)."""
    case = MOE["t7_e8_k2_h192_i192"]
    experts = build_global_experts(case)
    x, ids, w = build_inputs(case)
    kw = dict(accum_dtype=torch.float64, round_intermediate=True, out_dtype=torch.float64)
    plain = fused_moe_w4a16(x, ids, w, experts, **kw)
    cache: dict = {}
    first = fused_moe_w4a16(x, ids, w, experts, expert_cache=cache, **kw)
    assert torch.equal(first, plain)
    assert set(cache) == {(int(e), torch.float64) for e in ids.unique()}
    assert torch.equal(fused_moe_w4a16(x, ids, w, experts, expert_cache=cache, **kw), plain)
    stale = {k: type(v)(*(t * 2 for t in (v.gate, v.up, v.down)), v.scale_gate, v.scale_up, v.scale_down)
             for k, v in cache.items()}
    assert not torch.equal(fused_moe_w4a16(x, ids, w, experts, expert_cache=stale, **kw), plain)


def test_serving_model_rebuilds_kept_experts_after_prepare() -> None:
    """TinyModel keeps decoded experts between forwards and drops them in prepare() (every reload calls it):
    after the expert weights change in place, the next forward is the new weights'."""
    from fixtures.make_checkpoints import ensure_checkpoints
    from reference_impl.model.checkpoint import load_checkpoint
    from reference_impl.model import TinyModel, shard_weights, validate_checkpoint

    def weights(name):
        ckpt = load_checkpoint(ensure_checkpoints() / name)
        return validate_checkpoint(ckpt), shard_weights(validate_checkpoint(ckpt), ckpt.tensors)

    cfg, tensors = weights("moe-w4a16_nvfp4-a")
    _, fresh_b = weights("moe-w4a16_nvfp4-b")
    model = TinyModel(cfg, tensors)
    seqs = [torch.tensor([1, 5, 9, 2])]
    before = model.last_logits(seqs)
    assert any(model._expert_caches.values()), "the fixture's experts are small: they must be kept"
    for name, t in tensors.items():
        t.copy_(fresh_b[name])
    model.prepare()
    after = model.last_logits(seqs)
    want = TinyModel(cfg, weights("moe-w4a16_nvfp4-b")[1]).last_logits(seqs)
    assert torch.equal(after, want) and not torch.equal(before, after)
