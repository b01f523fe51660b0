"""Correct-but-different dense W4A16 backends (red team, tests/dense/redteam.py): other summation orders and
precisions, weights or AWQ inputs rounded as the contract allows. The suite must accept every one."""
from __future__ import annotations

import torch

from .redteam import (
    DenseRedTeam,
    awq_in_bf16,
    block_scales,
    decode_codes,
    pairwise_fp32,
    products,
    round_toward_zero_fp32,
    sequential_fp32,
    split_k,
)


class ReversedSequential(DenseRedTeam):
    name = "rt-ok-reversed"

    def accumulate(self, p, a):
        return sequential_fp32(products(a, p.w), reverse=True)


class ForwardSequential(DenseRedTeam):
    name = "rt-ok-forward"

    def accumulate(self, p, a):
        return sequential_fp32(products(a, p.w))


class Pairwise(DenseRedTeam):
    name = "rt-ok-pairwise"

    def accumulate(self, p, a):
        return pairwise_fp32(products(a, p.w))


class Blocked32(DenseRedTeam):
    """fp32 partials over 32-element blocks, then summed in fp32 from the last block."""
    name = "rt-ok-blocked32"

    def accumulate(self, p, a):
        prod = products(a, p.w)
        k = prod.shape[-1]
        parts = torch.stack([sequential_fp32(prod[..., s : s + 32]) for s in range(0, k, 32)], dim=-1)
        return sequential_fp32(parts, reverse=True)


class Fp64Accumulation(DenseRedTeam):
    name = "rt-ok-fp64"

    def accumulate(self, p, a):
        return a.double() @ p.w.double().T

    def epilogue(self, p, acc):
        out = acc * p.alpha
        if p.bias is not None:
            out = out + p.bias.double()
        return out.bfloat16()


class Fp32DequantBf16Gemm(DenseRedTeam):
    """Marlin-style: W * alpha dequantized in fp32 and rounded to BF16; BF16 GEMM, fp32 accumulation; x' in BF16."""
    name = "rt-ok-fp32-dequant-bf16-gemm"

    def prepare_dense(self, layer, device):
        p = super().prepare_dense(layer, device)
        p.w = (p.w * torch.tensor(p.alpha)).bfloat16().float()
        p.alpha = 1.0
        return p

    def activations(self, p, x2):
        return awq_in_bf16(p, x2)


class AlphaFoldedIntoScales(DenseRedTeam):
    """alpha folded into BF16 block scales, weights e2m1 * scale' rounded to BF16."""
    name = "rt-ok-alpha-in-bf16-scales"

    def prepare_dense(self, layer, device):
        p = super().prepare_dense(layer, device)
        s = (block_scales(layer.weight_scale.cpu()) * torch.tensor(p.alpha)).bfloat16().float()
        p.w = (decode_codes(layer.weight.cpu()) * s).bfloat16().float()
        p.alpha = 1.0
        return p


class SplitKFp32(DenseRedTeam):
    splits = 4
    name = "rt-ok-splitk4-fp32"

    def accumulate(self, p, a):
        parts = split_k(a, p.w, self.splits)
        return sum(parts[1:], parts[0])


class SplitK8Fp32(SplitKFp32):
    splits = 8
    name = "rt-ok-splitk8-fp32"


class TensorCoreRTZ(DenseRedTeam):
    """Each block of ``mma_k`` products summed exactly, added to the fp32 accumulator rounding toward zero."""
    mma_k = 16
    name = "rt-ok-tc-rtz16"

    def accumulate(self, p, a):
        prod = products(a, p.w).double()
        acc = torch.zeros(prod.shape[:-1], dtype=torch.float32)
        for s in range(0, prod.shape[-1], self.mma_k):
            acc = round_toward_zero_fp32(acc.double() + prod[..., s : s + self.mma_k].sum(-1))
        return acc


class TensorCoreRTZ32(TensorCoreRTZ):
    mma_k = 32
    name = "rt-ok-tc-rtz32"


class AwqBf16Prescale(DenseRedTeam):
    """x * pre_quant_scale rounded to BF16 before the GEMM (SGLang), the bound's term 4."""
    name = "rt-ok-awq-bf16"

    def activations(self, p, x2):
        return awq_in_bf16(p, x2)


class Kahan(DenseRedTeam):
    """Compensated fp32 summation (more accurate than plain fp32)."""
    name = "rt-ok-kahan"

    def accumulate(self, p, a):
        prod = products(a, p.w)
        s = torch.zeros(prod.shape[:-1])
        c = torch.zeros_like(s)
        for k in range(prod.shape[-1]):
            y = prod[..., k] - c
            t = s + y
            c = (t - s) - y
            s = t
        return s
class BiasAfterBf16Rounding(DenseRedTeam):
    """GEMM + alpha rounded to BF16, then ``out + bias`` in BF16: rounds twice, as engines do (``out = out + bias``);
    the contract allows it (reference_impl/bounds/dense.py, term 5) and the single-rounding cases carry no bias."""
    name = "rt-bias-after-bf16"

    def epilogue(self, p, acc):
        out = (acc * torch.tensor(p.alpha, dtype=torch.float32)).bfloat16()
        return out + p.bias.bfloat16() if p.bias is not None else out


CORRECT = [
    DenseRedTeam, ReversedSequential, ForwardSequential, Pairwise, Blocked32, Fp64Accumulation,
    Fp32DequantBf16Gemm, AlphaFoldedIntoScales, SplitKFp32, SplitK8Fp32, TensorCoreRTZ, TensorCoreRTZ32,
    AwqBf16Prescale, Kahan, BiasAfterBf16Rounding,
]


class AlphaOnActivationsBf16(DenseRedTeam):
    """alpha applied to the activations in BF16 (``x * alpha`` rounded) before an exact-weight GEMM: within the
    error bound (one rounding per activation, as the weight-rounding term allows for weights), but a second
    rounding the strict single-rounding checks flag where alpha is not a power of two (``cpu-alpha-1p5-*``)."""
    name = "rt-alpha-on-activations-bf16"

    def activations(self, p, x2):
        return (super().activations(p, x2) * torch.tensor(p.alpha)).bfloat16().float()

    def epilogue(self, p, acc):
        return self.to_output(acc + p.bias if p.bias is not None else acc)


#: Correct under the error-bound contract, double-rounding: flagged by the strict checks only (docs/dense.md).
STRICT_FLAGGED = [AlphaOnActivationsBf16]
