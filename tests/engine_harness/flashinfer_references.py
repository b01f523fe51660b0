"""FlashInfer's own test references for the W4A16 entry points, restated (our code; the facts are carried over
from FlashInfer's public test sources, main branch at fb28d7242 (2026-08-22), whose library constants match the
installed 0.7.4: ``_CUDNN_BF16_FP4_MIN_BACKEND_VERSION = 92301``, the 128x4 offset formula):

* ``tests/gemm/test_mm_bf16_fp4.py``: :func:`dense_dequantize` (``_dequantize_bf16_fp4_torch``: E2M1 table with codes
  8-15 negative, low nibble = even K, scales from the 128x4 swizzle via ``gemm_bf16_fp4._unswizzle_sf_128x4``,
  alpha multiplied into the weight), :func:`dense_reference` (``(a.float() @ W.T).to(bf16)``),
  :func:`dense_accepts` (``_assert_close_to_reference``: relative L2 < 2e-2 and cosine > 0.999),
  :func:`random_fp4_weights` (``_make_random_fp4_weights``: ``nvfp4_quantize`` with ``g_b = 2688 / amax``,
  ``alpha = 1 / g_b``; here FlashInfer's CPU quantizer model stands in for the GPU quantizer);
* ``tests/gemm/test_blackwell_bf16_fp4.py``: :func:`blackwell_weights` (codes and scales drawn directly, scales
  from {0.125 ... 2.0}, the canonical 128x4 buffer built by ``reshape(N/128, 4, 32, K_sf/4, 4).permute(0, 3, 2,
  1, 4)``), :func:`blackwell_reference` (fp32 "highest" product, alpha after, cast to the output dtype), checked
  with ``assert_close(atol=1e-2, rtol=1e-2)``; :data:`BLACKWELL_CASES` its parametrization;
* ``tests/moe/utils.py`` + ``tests/moe/test_cute_dsl_fused_moe.py``: :func:`moe_tensors` (``create_moe_tensors``:
  ``x = randn / 10``, weights ``randn / 10`` bf16, gated W1 rows ``[linear; gate]`` interleaved in 64-row groups
  before quantization with global scale 1 and swizzled scales, ``convert_sf_to_mma_layout``, alphas
  ``linspace(0.75, 1.25)`` / ``linspace(1.25, 0.75)``), :func:`moe_reference` (``compute_reference_moe_fp4`` in its
  W4A16 form: first half "linear" (up), second half gate, ``silu(gate) * linear`` or ``relu(.)^2``, routing
  weight times ``alpha2 * W2 @ act``, experts outside the rank skipped), :func:`moe_accepts` (``check_accuracy``:
  at least 97 % of elements with ``|d| < max(0.05, 1.5 max(std(ref), 0.01))`` or ``|d| / |ref| < 0.5``).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 16


# ----------------------------------------------------------------------------------------- dense
def unswizzle_sf_128x4(sf: torch.Tensor, n: int, k_sf: int) -> torch.Tensor:
    """Logical ``(n, k_sf)`` scale bytes out of a 128x4-swizzled buffer, by FlashInfer's offset formula."""
    flat = sf.contiguous().view(torch.uint8).reshape(-1)
    nn, kk = torch.meshgrid(torch.arange(n), torch.arange(k_sf), indexing="ij")
    offsets = ((nn // 128) * ((k_sf + 3) // 4) + kk // 4) * 512 + (nn % 32) * 16 + ((nn % 128) // 32) * 4 + kk % 4
    return flat[offsets]


def dense_dequantize(b: torch.Tensor, b_descale: torch.Tensor, alpha: torch.Tensor | None, n: int, k: int) -> torch.Tensor:
    codes = torch.stack([b.long() & 0xF, (b.long() >> 4) & 0xF], dim=-1).reshape(n, k)
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)[codes]
    sf = unswizzle_sf_128x4(b_descale, n, k // BLOCK).view(torch.float8_e4m3fn).float()
    weight = values * sf.repeat_interleave(BLOCK, dim=1)
    return weight * alpha.float() if alpha is not None else weight


def dense_reference(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (a.float() @ weight.T).to(torch.bfloat16)


def dense_figures(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    o, r = out.float().reshape(-1), ref.float().reshape(-1)
    rel_l2 = (torch.linalg.vector_norm(o - r) / torch.linalg.vector_norm(r).clamp_min(1e-6)).item()
    return rel_l2, F.cosine_similarity(o, r, dim=0).item()


def dense_accepts(out: torch.Tensor, ref: torch.Tensor) -> bool:
    rel_l2, cos = dense_figures(out, ref)
    return rel_l2 < 2e-2 and cos > 0.999


@functools.lru_cache(maxsize=32)
def random_fp4_weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed, swizzled scales, alpha)`` of a random bf16 matrix, quantized as FlashInfer's test does
    (memoized: treat as read-only)."""
    from flashinfer.batch_invariant.quantization.nvfp4_reference import quantize_reference

    mat = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    g_b = (448 * 6) / mat.float().abs().nan_to_num().max()
    packed, sf, _ = quantize_reference(mat, g_b)
    return packed, sf, torch.tensor([1.0 / g_b.item()], dtype=torch.float32)


#: test_mm_bf16_fp4.py PROBLEM_SIZES (M, N, K): its rows with N x K <= 320k (FlashInfer's CPU quantizer model,
#: which quantizes the inputs here, takes ~2 s per million weights), tiny, pow-2 and non-pow-2 alike.
DENSE_SIZES = [(1, 128, 128), (4, 256, 512), (16, 256, 256), (1, 192, 192), (2, 320, 256), (3, 448, 320),
               (5, 576, 192), (11, 832, 384), (48, 192, 1024), (96, 320, 768)]

# test_blackwell_bf16_fp4.py: (backend, (M, N, K), out dtype, alpha); left out on the CPU: its two LARGE_M
# (1,048,592-row) cases and the three with N x K > 4M (N4096xK4096, N2112xK2048, N3072xK3072).
_N, _T = "blackwell-native", "blackwell-tiled"
BLACKWELL_CASES = [
    (_N, (16, 1024, 1024), torch.bfloat16, None), (_T, (16, 1024, 1024), torch.bfloat16, None),
    (_N, (16, 1024, 1024), torch.float16, 0.75), (_T, (16, 1024, 1024), torch.bfloat16, 0.75),
    (_N, (7, 65, 48), torch.bfloat16, -0.5), (_N, (1, 129, 16), torch.float16, None),
    (_N, (129, 192, 128), torch.bfloat16, 0.75), (_T, (7, 4160, 192), torch.bfloat16, -0.5),
    (_T, (13, 192, 48), torch.bfloat16, None), (_T, (33, 128, 16), torch.bfloat16, 0.5),
    (_T, (5, 4096, 32), torch.bfloat16, None), (_T, (40, 256, 256), torch.bfloat16, -0.25),
    (_T, (17, 64, 80), torch.bfloat16, None), (_N, (33, 128, 192), torch.float16, 0.5),
]


def blackwell_weights(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed, canonical 128x4 scale buffer, fp32 weights they represent)``."""
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    values = mags[(codes & 7).long()]
    scale_values = torch.tensor([0.125, 0.25, 0.375, 0.5, 0.75, 1.0, 1.5, 2.0])
    scales = scale_values[torch.randint(len(scale_values), (n, k // BLOCK), generator=gen)]
    weights = torch.where((codes & 8) != 0, -values, values) * scales.repeat_interleave(BLOCK, dim=1)
    n_blocks, k_blocks = (n + 127) // 128, (k // BLOCK + 3) // 4
    padded = torch.zeros((n_blocks * 128, k_blocks * 4), dtype=torch.uint8)
    padded[:n, : k // BLOCK] = scales.to(torch.float8_e4m3fn).view(torch.uint8)
    canonical = padded.reshape(n_blocks, 4, 32, k_blocks, 4).permute(0, 3, 2, 1, 4).contiguous().reshape(-1)
    return packed, canonical, weights


def blackwell_reference(a: torch.Tensor, weights: torch.Tensor, alpha: float | None, out_dtype: torch.dtype) -> torch.Tensor:
    ref = a.float() @ weights.T
    return (ref * alpha if alpha is not None else ref).to(out_dtype)


# ----------------------------------------------------------------------------------------- MoE
def interleave_linear_and_gate(x: torch.Tensor, group: int = 64) -> torch.Tensor:
    """``[E, 2I, H]`` halves ``[linear; gate]`` -> 64-row groups ``linear[0:64], gate[0:64], ...``."""
    e, rows, h = x.shape
    return x.view(e, 2, rows // (2 * group), group, h).transpose(1, 2).reshape(e, rows, h)


def mma_view(swizzled: torch.Tensor, m: int, k: int, num_groups: int) -> torch.Tensor:
    """``convert_sf_to_mma_layout``: the ``(32, 4, m_tiles, 4, k_tiles, E)`` view of physical
    ``(E, m_tiles, k_tiles, 32, 4, 4)`` swizzled bytes."""
    m_tiles, k_tiles = (m + 127) // 128, (k // BLOCK + 3) // 4
    return swizzled.reshape(-1).view(num_groups, m_tiles, k_tiles, 32, 4, 4).permute(3, 4, 1, 5, 2, 0)


def moe_tensors(tokens: int, hidden: int, inter: int, experts: int, top_k: int, gated: bool, seed: int,
                num_local: int | None = None, offset: int = 0) -> dict:
    from flashinfer.batch_invariant.quantization.nvfp4_reference import quantize_reference

    gen = torch.Generator().manual_seed(seed)
    num_local = num_local or experts
    x = (torch.randn(tokens, hidden, generator=gen) / 10).to(torch.bfloat16)
    probs = torch.softmax(torch.randn(tokens, experts, generator=gen), dim=1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = (weights / weights.sum(dim=-1, keepdim=True)).float()
    rows = 2 * inter if gated else inter
    w1 = (torch.randn(num_local, rows, hidden, generator=gen) / 10).to(torch.bfloat16)
    w1_q_rows = interleave_linear_and_gate(w1) if gated else w1
    w1_q, w1_sf, _ = quantize_reference(w1_q_rows.reshape(num_local * rows, hidden), 1.0)
    w2 = (torch.randn(num_local, hidden, inter, generator=gen) / 10).to(torch.bfloat16)
    w2_q, w2_sf, _ = quantize_reference(w2.reshape(num_local * hidden, inter), 1.0)
    return dict(
        x=x, ids=ids.to(torch.int32), weights=weights, gated=gated, inter=inter, offset=offset, num_experts=experts,
        w1_bf16=w1, w1=w1_q.view(num_local, rows, hidden // 2), w1_sf=mma_view(w1_sf, rows, hidden, num_local),
        w1_alpha=torch.linspace(0.75, 1.25, num_local), w2_bf16=w2,
        w2=w2_q.view(num_local, hidden, inter // 2), w2_sf=mma_view(w2_sf, hidden, inter, num_local),
        w2_alpha=torch.linspace(1.25, 0.75, num_local),
    )


def moe_reference(t: dict, w1: torch.Tensor, w2: torch.Tensor, alpha1: torch.Tensor | None = None,
                  alpha2: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``compute_reference_moe_fp4`` (W4A16): ``w1 [E, rows, H]`` with halves ``[linear; gate]`` (not
    interleaved), ``w2 [E, H, I]``; ``alpha*`` default to ones (the W4A16 test folds them into the weights)."""
    x, ids, weights, inter = t["x"].to(dtype), t["ids"].long(), t["weights"].to(dtype), t["inter"]
    n_local = w1.shape[0]
    alpha1 = torch.ones(n_local, dtype=dtype) if alpha1 is None else alpha1.to(dtype)
    alpha2 = torch.ones(n_local, dtype=dtype) if alpha2 is None else alpha2.to(dtype)
    out = torch.zeros(x.shape, dtype=dtype)
    for local in range(n_local):
        token, slot = (ids == local + t["offset"]).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        g1 = alpha1[local] * (x[token] @ w1[local].to(dtype).T)
        if t["gated"]:
            linear, gate = g1[:, :inter], g1[:, inter:]
            act = gate * torch.sigmoid(gate) * linear
        else:
            act = torch.relu(g1) ** 2
        out.index_add_(0, token, (weights[token, slot] * alpha2[local])[:, None] * (act @ w2[local].to(dtype).T))
    return out


def moe_accuracy(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``check_accuracy``'s share of elements within its tolerance (the test requires >= 0.97)."""
    a, e = actual.float(), expected.float()
    atol = max(0.05, 1.5 * max(e.std().item(), 0.01))
    diff = (a - e).abs()
    return ((diff < atol) | (diff / (e.abs() + 1e-8) < 0.5)).float().mean().item()


MOE_ACCEPT_SHARE = 0.97


def moe_dequantized(t: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp64 weights the kernel-layout tensors represent, W1 back in ``[linear; gate]`` order (FlashInfer's
    stated layout: 64-row groups ``linear, gate``), for the reference on the represented weights."""
    def deq(packed, sf_view, rows, k):
        e = packed.shape[0]
        swizzled = sf_view.permute(5, 2, 4, 0, 1, 3).reshape(e, -1)
        return torch.stack([dense_dequantize(packed[i], swizzled[i], None, rows, k) for i in range(e)]).double()

    e, rows, h = t["w1"].shape[0], t["w1"].shape[1], t["w1"].shape[2] * 2
    w1 = deq(t["w1"], t["w1_sf"], rows, h)
    if t["gated"]:
        w1 = w1.view(e, rows // 128, 2, 64, h).transpose(1, 2).reshape(e, rows, h)  # undo the interleave
    w2 = deq(t["w2"], t["w2_sf"], t["w2"].shape[1], t["inter"])
    return w1, w2
