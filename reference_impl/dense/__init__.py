"""W4A16 dense linear: BF16 activations times an NVFP4 weight (the contract: docs/dense.md).

``y = ((x * pre_quant_scale) @ dequant(W)^T) * alpha + bias`` where ``alpha`` is the weight decode scale
only (``max(weight_scale_2)`` over fused shards, as engines fold one alpha per layer). Under W4A4 alpha
would also hold ``input_scale``: that belongs to the other mode and is never applied here.

How the reference evaluates it (the "BF16-dequant reference", :func:`prepare_w4a16_linear` once per layer,
:func:`run_w4a16_linear` per call):

* ``W = e2m1 * e4m3`` is decoded once into **bf16**, exactly (at most 6 significant bits in [2^-10, 2688]:
  :func:`reference_impl.format.nvfp4.codes_times_block_scales`).
* The GEMM runs on bf16 operands with fp32 accumulation: every product ``x_k * w_k`` (8 x 6 significant
  bits) is exact in fp32, so this is the same fp32 sum of exact products an fp32 GEMM on the decoded weight
  computes, at tensor-core speed. On CUDA (torch >= 2.8) it is one cuBLAS call with the epilogue fused:
  ``torch.addmm(bias, x, W^T, alpha=alpha)`` with a bf16 output (:func:`_addmm_bf16_out`: ``alpha * acc +
  bias`` in fp32, one conversion to bf16) when the output is bf16 and the bias bf16 or absent, otherwise
  ``torch.addmm(..., out_dtype=torch.float32)`` and one cast. Everywhere else (CPU, or a CUDA torch without
  the fp32-output overload) the accumulator is :func:`reference_impl.dense.exact_dot.exact_matmul_fp32`: the
  exact sum of the exact products, rounded to fp32 (fp64 GEMMs on exact slices of ``x``; small layers keep
  the fp64 upcast of ``W``, large ones upcast one row chunk at a time), then ``* alpha`` and ``+ bias`` in
  fp32, one rounding each. Folding alpha and bias into the GEMM epilogue rounds at most as often as a
  separate multiply and add, which the bound counts (``reference_impl/bounds/dense.py``, term 2: ``K + 2``
  roundings); the exact accumulator rounds once instead of up to ``K`` times.
* AWQ: ``x' = x * pre_quant_scale`` is formed exactly in fp32 (bf16 x bf16 = 16 significant bits), as
  docs/dense.md defines it. A bf16 GEMM cannot take 16-bit operands, so ``x'`` is split exactly into
  ``hi + lo`` (``hi = bf16(x')``, ``lo = x' - hi``: a 16-bit value minus its 8-bit rounding has at most 8
  significant bits, so ``lo`` is a bf16 too) and both halves go through the GEMM into the same fp32
  output (a second ``addmm`` with ``beta = 1``). That is a fp32 sum of ``2K`` exact products: its error is
  at most ``gamma_{2K+2} (1 + 2^-7) A``, inside the dense bound's ``gamma_{K+2} A + 2 * 2^-8 A`` (its
  accumulation, AWQ and weight-rounding terms; this path rounds neither x' nor W) for every K up to 2^15
  (``reference_impl/bounds/dense.py``).
* One rounding to the output dtype at the end.

Determinism, by construction (``run_w4a16_linear`` on the same prepared layer and input gives the same bits,
whatever the load, the thread count or the BLAS): on the exact path no sum depends on an order (see
:mod:`reference_impl.dense.exact_dot`: a CPU BLAS may choose its K-sum order per call, oneMKL by thread count and
``MKL_DYNAMIC``, so an fp32 ``addmm`` is not reproducible there). On CUDA, one cuBLAS call per GEMM (two for
AWQ, in a fixed order); cuBLAS documents bitwise-identical results from run to run on GPUs of the same
architecture and SM count with the same toolkit (its exceptions -- atomics-mode routines, several streams
sharing one handle without a fixed workspace -- are not used here), whatever kernel or split-K its heuristic
picks for a shape, and split-K partial sums stay fp32 (``allow_bf16_reduced_precision_reduction`` is off for
the bf16-out call). Results may differ between a CPU and a GPU, or between GPU models: each is within the bound.

Measured on an H200 (``benchmarks/bench_dense.py``): 0.93x-1.09x of a BF16 ``torch.matmul`` of the same
shape at every LLM shape of the cuda tier and M in {1, 16, 256, 4096}.

Memory: the prepared layer holds one bf16 copy of ``W`` (``2 N K`` bytes) next to the checkpoint bytes
(decoding it needs one more chunk of temporaries, ``nvfp4.DECODE_CHUNK_ELEMENTS``); a call allocates its
output (fp32 on the unfused paths; AWQ: also the two bf16 halves of ``x'``; exact path: an fp64 weight
chunk of ``_CHUNK_ELEMENTS`` and the fp64 slices of ``x``, or the kept fp64 upcast of a layer no larger than
that). The fp64 evaluation
(:func:`w4a16_linear_exact`, ``accum_dtype=torch.float64``) decodes ``_CHUNK_ELEMENTS`` weights at a time.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from reference_impl.dense.exact_dot import exact_matmul, exact_matmul_fp32
from reference_impl.format.nvfp4 import BLOCK_SIZE, codes_times_block_scales

# Weight elements upcast at once (128 MiB in fp64) by the fp64 path and the CPU fallback: their extra
# memory is one chunk of W, never a whole upcast layer.
_CHUNK_ELEMENTS = 1 << 24


def _chunk_rows(k: int) -> int:
    return max(1, _CHUNK_ELEMENTS // k)


def dense_alpha(weight_scale_2: torch.Tensor) -> torch.Tensor:
    """The W4A16 GEMM alpha: the largest per-shard decode scale, fp32 0-d."""
    return weight_scale_2.detach().float().reshape(-1).max()


def check_dense_layer(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    pre_quant_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> None:
    """Raise ``TypeError``/``ValueError`` with a readable message for layer tensors that do not fit."""
    if weight.dtype != torch.uint8 or weight.dim() != 2:
        raise TypeError(f"packed weight must be a 2-D uint8 tensor, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape[0], weight.shape[1] * 2
    if weight_scale.shape != (n, k // BLOCK_SIZE):
        raise ValueError(f"block scale shape {tuple(weight_scale.shape)} != ({n}, {k // BLOCK_SIZE}) (linear layout)")
    if pre_quant_scale is not None and pre_quant_scale.shape != (k,):
        raise ValueError(f"pre_quant_scale shape {tuple(pre_quant_scale.shape)} != ({k},)")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias shape {tuple(bias.shape)} != ({n},)")


def _check_activations(x: torch.Tensor, k: int) -> None:
    if x.dtype != torch.bfloat16:
        raise TypeError(f"W4A16 activations must be bfloat16, got {x.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"activation K = {x.shape[-1]} does not match weight K = {k}")


def check_dense_inputs(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    pre_quant_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> None:
    """Raise ``TypeError``/``ValueError`` with a readable message for inputs that do not fit."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"W4A16 activations must be bfloat16, got {x.dtype}")
    check_dense_layer(weight, weight_scale, pre_quant_scale, bias)
    _check_activations(x, weight.shape[1] * 2)


# ----------------------------------------------------------------------------------------- fp32 GEMM
_FP32_OUT_GEMM: dict[tuple[str, int | None], bool] = {}


def uses_cublas_fp32_gemm(device: torch.device) -> bool:
    """Whether the fp32-accumulating GEMMs run as bf16 cuBLAS calls with fp32 output on ``device`` (CUDA with
    :func:`has_fp32_out_bf16_gemm`); everywhere else they run as :func:`reference_impl.dense.exact_dot.exact_matmul`
    (a BLAS's summation order is not reproducible on CPU; cuBLAS's is, module docstring)."""
    return device.type == "cuda" and has_fp32_out_bf16_gemm(device)


def has_fp32_out_bf16_gemm(device: torch.device) -> bool:
    """Whether this torch build has a bf16 x bf16 -> fp32 ``addmm`` (``out_dtype=torch.float32``) on
    ``device`` (CUDA torch >= 2.8; not CPU torch 2.13). Probed once per device."""
    key = (device.type, device.index)
    if key not in _FP32_OUT_GEMM:
        a = torch.ones(2, 16, dtype=torch.bfloat16, device=device)
        try:
            y = torch.addmm(torch.zeros(2, dtype=torch.float32, device=device), a, a.T, alpha=0.5,
                            out_dtype=torch.float32)
            _FP32_OUT_GEMM[key] = y.dtype == torch.float32 and bool((y == 8.0).all())
        except (RuntimeError, TypeError, NotImplementedError):
            _FP32_OUT_GEMM[key] = False
    return _FP32_OUT_GEMM[key]


def _addmm_fp32(bias: torch.Tensor, a: torch.Tensor, w: torch.Tensor, alpha: float,
                accumulate: torch.Tensor | None = None, w_fp64: torch.Tensor | None = None) -> torch.Tensor:
    """``alpha * (a @ w^T) + bias`` (``+ accumulate`` instead of ``+ bias`` when given), fp32 ``[M, N]``,
    from ``a [M, K]`` (bf16, or fp32 on the exact path) and bf16 ``w [N, K]``, accumulated in fp32.
    ``w_fp64``: the exact path's kept fp64 copy of ``w``, if any."""
    c = bias if accumulate is None else accumulate
    if a.dtype == torch.bfloat16 and uses_cublas_fp32_gemm(a.device):
        return torch.addmm(c, a, w.T, alpha=alpha, out_dtype=torch.float32)
    n, step = w.shape[0], _chunk_rows(w.shape[1])
    if w_fp64 is not None or step >= n:
        acc = exact_matmul_fp32(a, w_fp64 if w_fp64 is not None else w)
    else:  # the result is row-by-row of W, so chunking changes nothing (exact_dot module docstring)
        acc = torch.cat([exact_matmul_fp32(a, w[start:start + step]) for start in range(0, n, step)], dim=1)
    return acc.mul_(alpha).add_(c)  # the fp32 epilogue: one rounding each, in this order


def _addmm_bf16_out(bias_bf16: torch.Tensor, a: torch.Tensor, w: torch.Tensor, alpha: float) -> torch.Tensor:
    """``bf16(alpha * (a @ w^T) + bias)`` in one cuBLAS call: fp32 accumulation (compute type 32F), the
    epilogue ``alpha * acc + bias`` in fp32 (scale type 32F) and one conversion of its result to bf16 --
    the same value as the fp32-output GEMM followed by a cast (measured bitwise equal on an H200 for every
    perf shape), without the second kernel and with cuBLAS's faster bf16-output GEMMs. PyTorch lets cuBLAS
    reduce split-K partial sums in the *output* type (bf16) unless told otherwise, which would add
    roundings: ``allow_bf16_reduced_precision_reduction`` is switched off for the call."""
    matmul = torch.backends.cuda.matmul
    previous = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        return torch.addmm(bias_bf16, a, w.T, alpha=alpha)
    finally:
        matmul.allow_bf16_reduced_precision_reduction = previous


# ----------------------------------------------------------------------------------------- prepared layer
@dataclass(frozen=True)
class PreparedLinear:
    """A W4A16 linear layer decoded once for bf16 GEMMs (module docstring).

    ``weight`` bf16 ``[N, K]`` = ``e2m1 * e4m3`` exactly (``weight_scale_2`` not applied); ``alpha`` the
    fp32 decode scale (a Python float holding an fp32 value exactly); ``bias`` fp32 ``[N]`` (zeros when the
    layer has none: the fused epilogue takes one, and ``+ 0`` changes nothing but the sign of a zero);
    ``pre_quant_scale`` fp32 ``[K]`` or None; ``weight_fp64``: where the GEMMs run exactly (no cuBLAS:
    :func:`uses_cublas_fp32_gemm`) and the layer has at most ``_CHUNK_ELEMENTS`` weights, the exact path
    keeps its fp64 upcast (one chunk) instead of upcasting on every call."""

    weight: torch.Tensor
    alpha: float
    bias: torch.Tensor
    pre_quant_scale: torch.Tensor | None = None
    weight_fp64: torch.Tensor | None = None
    #: The bias as bf16 when that is exact (no bias, or a bf16 one): enables the fused bf16-output GEMM.
    bias_bf16: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]


def prepare_w4a16_linear(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    pre_quant_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> PreparedLinear:
    """Decode a checkpoint layer (``weight [N, K/2]`` uint8, ``weight_scale [N, K/16]`` e4m3 linear,
    ``weight_scale_2`` fp32 one per fused shard) for :func:`run_w4a16_linear`, on the weight's device."""
    check_dense_layer(weight, weight_scale, pre_quant_scale, bias)
    n, device = weight.shape[0], weight.device
    decoded = codes_times_block_scales(weight, weight_scale)
    alpha = float(dense_alpha(weight_scale_2))
    fp32_bias = torch.zeros(n, dtype=torch.float32, device=device) if bias is None else bias.to(device, torch.float32)
    pqs = None if pre_quant_scale is None else pre_quant_scale.to(device, torch.float32)
    small = decoded.numel() <= _CHUNK_ELEMENTS and not uses_cublas_fp32_gemm(device)
    bias_bf16 = None
    if bias is None or bias.dtype == torch.bfloat16:
        bias_bf16 = fp32_bias.to(torch.bfloat16)  # exact: the values came from bf16 (or are zeros)
    return PreparedLinear(decoded, alpha, fp32_bias, pqs, decoded.double() if small else None, bias_bf16)


def run_w4a16_linear(prepared: PreparedLinear, x: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``x [..., K]`` bf16 -> ``[..., N]`` in ``out_dtype``: fp32 accumulation, fp32 epilogue, one rounding."""
    _check_activations(x, prepared.in_features)
    lead, n = x.shape[:-1], prepared.out_features
    x2 = x.reshape(-1, x.shape[-1])
    w, alpha, bias = prepared.weight, prepared.alpha, prepared.bias
    fused = prepared.pre_quant_scale is None and out_dtype == torch.bfloat16 and prepared.bias_bf16 is not None
    if fused and x.device.type == "cuda" and uses_cublas_fp32_gemm(x.device):
        return _addmm_bf16_out(prepared.bias_bf16, x2, w, alpha).reshape(*lead, n)
    if prepared.pre_quant_scale is None:
        out = _addmm_fp32(bias, x2, w, alpha, w_fp64=prepared.weight_fp64)
    elif not uses_cublas_fp32_gemm(x.device):  # the exact path takes x' in fp32 directly (exact)
        out = _addmm_fp32(bias, x2.float() * prepared.pre_quant_scale, w, alpha, w_fp64=prepared.weight_fp64)
    else:
        scaled = x2.float() * prepared.pre_quant_scale  # exact: 8 x 8 significant bits
        hi = scaled.to(torch.bfloat16)
        lo = (scaled - hi.float()).to(torch.bfloat16)  # exact: at most 8 significant bits remain
        out = _addmm_fp32(bias, lo, w, alpha, accumulate=_addmm_fp32(bias, hi, w, alpha))
    return out.reshape(*lead, n).to(out_dtype)


# ----------------------------------------------------------------------------------------- one-shot forms
def _decoded_rows(weight: torch.Tensor, weight_scale: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``start:stop`` of ``e2m1 * e4m3`` in ``dtype`` (exact in bf16, hence in fp32 and fp64)."""
    return codes_times_block_scales(weight[start:stop], weight_scale[start:stop]).to(dtype)


def w4a16_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    pre_quant_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    accum_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The reference W4A16 linear layer. ``x [..., K]`` bf16, ``weight [N, K/2]`` uint8, ``weight_scale
    [N, K/16]`` e4m3 (linear), ``weight_scale_2`` fp32 (one per fused shard). Accumulates in
    ``accum_dtype``: fp32 (default) is :func:`prepare_w4a16_linear` + :func:`run_w4a16_linear`; fp64
    evaluates the formula in fp64 (``(x * pqs) @ W^T``, then ``* alpha``, then ``+ bias``), a chunk of
    decoded rows at a time. Layers used more than once should be prepared once instead."""
    check_dense_inputs(x, weight, weight_scale, pre_quant_scale, bias)
    if accum_dtype == torch.float32:
        prepared = prepare_w4a16_linear(weight, weight_scale, weight_scale_2, pre_quant_scale, bias)
        return run_w4a16_linear(prepared, x, out_dtype)
    xa = x.to(accum_dtype)
    if pre_quant_scale is not None:
        xa = xa * pre_quant_scale.to(accum_dtype)
    xa = xa.reshape(-1, xa.shape[-1])
    n = weight.shape[0]
    out = torch.empty(xa.shape[0], n, dtype=accum_dtype, device=x.device)
    step = _chunk_rows(xa.shape[-1])
    for start in range(0, n, step):  # e2m1 * e4m3 is exact in any float format here, so chunking changes nothing
        stop = min(start + step, n)
        w = _decoded_rows(weight, weight_scale, start, stop, accum_dtype)
        out[:, start:stop] = exact_matmul(xa, w) if accum_dtype == torch.float64 else xa @ w.T
    out.mul_(dense_alpha(weight_scale_2).to(accum_dtype))  # in place: peak extra memory stays one output
    if bias is not None:
        out.add_(bias.to(accum_dtype))
    return out.reshape(*x.shape[:-1], n).to(out_dtype)


def w4a16_linear_exact(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    pre_quant_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact value and its magnitude, both fp64 ``[..., N]``, for error bounds:

    * ``y_exact = ((x * pqs) @ W^T) * alpha + bias`` evaluated in fp64. Every product ``x * pqs`` (bf16 times
      fp32: at most 32 significant bits) and ``x' * w`` (with ``w = e2m1 * e4m3``, 6 bits) is exact in fp64;
      the K-sum is :func:`reference_impl.dense.exact_dot.exact_matmul` (exact per slice, the slices added in a
      fixed order: the same bits on every run, thread count and device, within 2^-52 relative of the exact
      sum), then one fp64 rounding each for ``* alpha`` and ``+ bias``.
    * ``magnitude = (|x * pqs| @ |W|^T) * alpha`` (no bias): the scale of the accumulation error.

    IEEE semantics carry through: a NaN/Inf activation gives a non-finite exact value wherever IEEE fp64
    says so. Decodes ``_CHUNK_ELEMENTS`` weights at a time (bf16, exact, then upcast), like the fp64 path of
    :func:`w4a16_linear`."""
    check_dense_inputs(x, weight, weight_scale, pre_quant_scale, bias)
    f64 = torch.float64
    xa = x.to(f64)
    if pre_quant_scale is not None:
        xa = xa * pre_quant_scale.to(f64)
    xa = xa.reshape(-1, xa.shape[-1])
    xabs = xa.abs()
    n = weight.shape[0]
    exact = torch.empty(xa.shape[0], n, dtype=f64, device=x.device)
    magnitude = torch.empty_like(exact)
    step = _chunk_rows(xa.shape[-1])
    for start in range(0, n, step):
        stop = min(start + step, n)
        w = _decoded_rows(weight, weight_scale, start, stop, f64)
        exact[:, start:stop] = exact_matmul(xa, w)
        magnitude[:, start:stop] = exact_matmul(xabs, w.abs_())
        del w
    alpha = dense_alpha(weight_scale_2).to(f64)
    exact *= alpha
    magnitude *= alpha
    if bias is not None:
        exact += bias.to(f64)
    lead = x.shape[:-1]
    return exact.reshape(*lead, n), magnitude.reshape(*lead, n)
