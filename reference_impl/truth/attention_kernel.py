"""The probed attention's ``T^2`` work in two Triton kernels (CUDA, fp32 probed passes), flash-attention style:
nothing of size ``T^2`` is written to memory. What :func:`reference_impl.truth.by_hand.probed_attention_block`
computes in eager passes over ``[S, K, H, Tq, Tk]`` tensors (a long prefill's cost), with the same rounding model:

* ``primal_kernel`` (reference_impl/truth/_attention_triton.py), per query block: the causal softmax's row
  max ``m`` and sum ``l``, the output ``o = p v`` and ``p |v|`` (the output store's error weights) -- once per
  sequence and head;
* ``tangent_kernel``, per query block and replica: for every key block up to the block's last query, the
  scores' tangent ``st = (qt k^T + q kt^T) scale`` (keys and key tangents centred over the keys: the same
  softmax tangent, without a shared mean in the TF32 products) plus the scores store's own draws (``dot``:
  ``hypot(U s, U_ACCUM (d + 2) |q| |k|^T scale) z1``), the softmax's ``p (t - sum p t)``, the probabilities'
  store (``round``: ``U p z2``) and the products with ``v`` and ``vt``, accumulated in registers.

The output's own store (``dot`` over the sequence's keys) is the eager one (:meth:`Probe.store_tangent`). The
draws are Triton's Philox normals, keyed by the probe's keys (a block per call, one stream per sequence, head
and replica, consecutive keys: no key is another kernel's), not the eager path's: the same distribution, other
numbers. fp32 products run in TF32, as the eager path's on CUDA, but the scores that feed the softmax: in
:attr:`KernelConfig.scores`' precision, the same in both kernels.

Off unless ``TRUTH_ATTENTION_KERNEL=1``: their arithmetic and draws are checked under Triton's CPU interpreter
and on a GPU (tests/reference/test_truth_attention_kernel.py), but in their first configuration they were slower
than the eager path on an H100 (docs/truth.md); ``benchmarks/bench_attention_kernel.py`` measures the others."""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

#: head dimensions the kernels take (a power of two, as tl.arange needs)
HEAD_DIMS = (16, 32, 64, 128)


class KernelConfig(NamedTuple):
    """How the kernels run: query and key rows per block, warps and software-pipelining stages per program, and
    the scores' product precision (Triton's ``input_precision``: ``tf32x3`` about fp32's rounding on tensor
    cores, ``ieee`` fp32 without them, ``tf32`` 10 bits as the eager path's TF32 products). Measured by
    ``benchmarks/bench_attention_kernel.py``; ``TRUTH_ATTENTION_CONFIG="64,32,8,1,tf32x3"`` overrides it."""

    block_m: int = 64
    block_n: int = 32
    warps: int = 8
    stages: int = 1
    scores: str = "ieee"

    @classmethod
    def parse(cls, text: str) -> "KernelConfig":
        """``"BLOCK_M,BLOCK_N,WARPS,STAGES,PRECISION"`` (e.g. ``64,32,8,1,tf32x3``) as a configuration."""
        parts = [x.strip() for x in text.split(",")]
        if len(parts) != 5 or parts[4] not in ("ieee", "tf32", "tf32x3") or not all(x.isdigit() for x in parts[:4]):
            raise ValueError(f"attention kernel configuration {text!r}: expected BLOCK_M,BLOCK_N,WARPS,STAGES,"
                             "PRECISION (e.g. 64,32,8,1,tf32x3)")
        return cls(*(int(x) for x in parts[:4]), parts[4])

    @classmethod
    def from_environment(cls) -> "KernelConfig":
        """``TRUTH_ATTENTION_CONFIG``'s configuration (:meth:`parse`), the default where it is unset."""
        text = os.environ.get("TRUTH_ATTENTION_CONFIG", "").strip()
        try:
            return cls.parse(text) if text else cls()
        except ValueError as exc:
            raise ValueError(f"TRUTH_ATTENTION_CONFIG: {exc}") from None


def available(query: torch.Tensor) -> bool:
    """Whether the kernels serve this probed attention: ``TRUTH_ATTENTION_KERNEL=1``, CUDA fp32 rows, a head
    dimension of :data:`HEAD_DIMS`, Triton importable (only then imported: a CPU truth never needs it)."""
    if not (os.environ.get("TRUTH_ATTENTION_KERNEL") == "1" and query.is_cuda and query.dtype == torch.float32
            and query.shape[-1] in HEAD_DIMS):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _strides3(x: torch.Tensor) -> tuple[int, int, int]:
    if x.stride(-1) != 1:
        raise ValueError("the head dimension must be contiguous")
    return x.stride(0), x.stride(1), x.stride(2)


def probed_attention(q1, k1, v1, qt, kt, vt, scale: float, u_bf16: float, c_acc: float, seed: int,
                     config: KernelConfig | None = None):
    """``(out, pav, ot)`` of causal attention under probes: ``q1, k1, v1`` ``[S, H, T, D]`` each sequence's primal,
    ``qt, kt, vt`` ``[S K, H, T, D]`` its replicas' tangents (sequence s, replica r at ``s K + r``); ``out`` and
    ``pav = p |v|`` ``[S, H, Tq, D]``, ``ot`` ``[S K, H, Tq, D]`` the tangent before the output's store. ``u_bf16``,
    ``c_acc``: the stores' BF16 unit and accumulation weight ``U_ACCUM (D + 2)`` (0, 0: no draws). ``config``:
    default :meth:`KernelConfig.from_environment`."""
    s_, heads, t_q, d = q1.shape
    t_k = k1.shape[2]
    reps = qt.shape[0] // s_
    if t_k * t_k >= 2 ** 31:
        raise ValueError(f"{t_k} keys: the draws' offsets (query x key) overflow 32 bits")
    import triton

    from reference_impl.truth._attention_triton import primal_kernel, tangent_kernel

    config = config or KernelConfig.from_environment()
    bm, bn = config.block_m, config.block_n
    out = q1.new_empty(s_, heads, t_q, d)
    pav, ot = torch.empty_like(out), q1.new_empty(s_ * reps, heads, t_q, d)
    m, lsum = q1.new_empty(s_, heads, t_q), q1.new_empty(s_, heads, t_q)
    grid = (triton.cdiv(t_q, bm), s_ * heads)
    common = dict(BM=bm, BN=bn, D=d, SCORES=config.scores)
    launch = {} if os.environ.get("TRITON_INTERPRET") == "1" else dict(num_warps=config.warps,
                                                                       num_stages=config.stages)
    primal_kernel[grid](q1, k1, v1, m, lsum, out, pav, scale, t_q, t_k, t_k - t_q, heads,
                         *_strides3(q1), *_strides3(k1), *_strides3(v1), **common, **launch)
    kbar, ktbar = k1.mean(2).contiguous(), kt.mean(2).contiguous()  # [S, H, D], [S K, H, D]
    tangent_kernel[grid + (reps,)](q1, k1, v1, qt, kt, vt, kbar, ktbar, m, lsum, out, ot, seed, scale, u_bf16,
                                   c_acc, t_q, t_k, t_k - t_q, heads, reps,
                                   *_strides3(q1), *_strides3(k1), *_strides3(v1),
                                   *_strides3(qt), *_strides3(kt), *_strides3(vt), **common, **launch)
    return out, pav, ot
