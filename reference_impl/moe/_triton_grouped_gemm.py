"""A Triton grouped GEMM for the fp32-accumulating MoE reference on CUDA (:mod:`reference_impl.moe.grouped`).

``out[row_out(j), n] = row_scale[j] * (col_scale(e, n) * sum_k A[row_a(j), k] * W[e, n, k])`` for the rows
``j`` of each expert's segment, ``e`` the segment's expert. bf16 operands, fp32 accumulation (``tl.dot``
with an fp32 accumulator), fp32 output: the products of bf16 values are exact in fp32, so this is an fp32
sum of exact products, like ``torch.mm(..., out_dtype=torch.float32)``; the two epilogue multiplies are the
reference's ``acc * decode_scale`` and ``* routing_weight`` (one fp32 rounding each).

Why it exists: PyTorch has no grouped GEMM with an fp32 output (``torch._grouped_mm`` returns bf16 only),
and one cuBLAS call per expert costs a kernel launch per expert (256 for a DeepSeek-like layer), which is
slower than the GEMMs themselves at small token counts. One launch covers every expert here; programs of
blocks past the last expert's segment return at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, a_rows_ptr, w_ptr, out_ptr, out_rows_ptr,
    block_expert_ptr, block_ends_ptr, counts_ptr, seg_start_ptr,
    scale_a_ptr, scale_b_ptr, row_scale_ptr,
    num_blocks, num_experts, N, K, split,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    HAS_A_ROWS: tl.constexpr, HAS_OUT_ROWS: tl.constexpr, HAS_ROW_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    size_m = min(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m

    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:  # past the last expert's blocks
        return
    count = tl.load(counts_ptr + expert)
    first_row = tl.load(seg_start_ptr + expert)
    first_block = tl.load(block_ends_ptr + expert) - tl.cdiv(count, BLOCK_M)
    start = first_row + (pid_m - first_block) * BLOCK_M
    end = first_row + count
    offs_m = start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    if HAS_A_ROWS:
        rows_a = tl.load(a_rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    else:
        rows_a = offs_m.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
              + offs_k[:, None] * stride_wk)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    scale_a = tl.load(scale_a_ptr + expert)
    scale_b = tl.load(scale_b_ptr + expert)
    acc = acc * tl.where(offs_n < split, scale_a, scale_b)[None, :]
    if HAS_ROW_SCALE:
        acc = acc * tl.load(row_scale_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
    if HAS_OUT_ROWS:
        rows_out = tl.load(out_rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    else:
        rows_out = offs_m.to(tl.int64)
    out_ptrs = out_ptr + rows_out[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])


#: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by the average rows per expert (up to the key).
CONFIGS = ((16, (16, 128, 128, 4, 4)), (48, (32, 128, 128, 4, 4)), (96, (64, 128, 64, 4, 4)),
           (None, (128, 256, 64, 8, 3)))
GROUP_M = 8


def pick_config(rows: int, experts_with_rows: int) -> tuple[int, int, int, int, int]:
    avg = rows / max(1, experts_with_rows)
    for limit, config in CONFIGS:
        if limit is None or avg <= limit:
            return config
    raise AssertionError("unreachable")


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    counts: torch.Tensor,
    seg_start: torch.Tensor,
    rows: int,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    split: int,
    out: torch.Tensor,
    a_rows: torch.Tensor | None = None,
    out_rows: torch.Tensor | None = None,
    row_scale: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """Segments ``[seg_start[e], seg_start[e] + counts[e])`` of ``rows`` sorted rows, one per expert ``e``
    of ``w [E, N, K]`` (bf16); ``a`` bf16 (row ``a_rows[j]`` for row ``j``, or ``j``); columns ``n <
    split`` scaled by ``scale_a[e]``, the others by ``scale_b[e]``; then by ``row_scale[j]``; stored to
    ``out[out_rows[j]]`` (or ``out[j]``), fp32. Returns ``out``."""
    num_experts, n, k = w.shape
    bm, bn, bk, warps, stages = config or pick_config(rows, min(num_experts, rows))
    max_blocks = triton.cdiv(rows, bm) + min(num_experts, rows)
    ends = torch.cumsum((counts + bm - 1) // bm, 0)
    block_expert = torch.searchsorted(ends, torch.arange(max_blocks, device=a.device), right=True)
    dummy = counts  # never read when the matching HAS_* flag is off
    grid = (max_blocks * triton.cdiv(n, bn),)
    _grouped_gemm_kernel[grid](
        a, a_rows if a_rows is not None else dummy, w, out, out_rows if out_rows is not None else dummy,
        block_expert, ends, counts, seg_start,
        scale_a, scale_b, row_scale if row_scale is not None else scale_a,
        max_blocks, num_experts, n, k, split,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        HAS_A_ROWS=a_rows is not None, HAS_OUT_ROWS=out_rows is not None, HAS_ROW_SCALE=row_scale is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=GROUP_M, num_warps=warps, num_stages=stages,
    )
    return out
