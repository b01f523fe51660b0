"""A probed store's draw and add in one Triton kernel (CUDA, fp32 probed passes): ``upstream + std z`` with ``z``
standard normals drawn in the kernel (Triton's Philox), each sequence's ``std`` read for its replicas. The eager
path (:meth:`reference_impl.truth.probe_draws.Probe._tangent`) writes the normals to memory, then reads them, the
upstream tangent and the broadcast ``std`` to write the sum: four passes over a replicated tensor where this
makes two, the largest elementwise cost of a probed pass (the MLP's ``[S, K, T, 14336]`` stores, a long
prefill's ``[S, K, H, Tq, Tk]`` scores and probabilities).

The draws are not the eager path's numbers: the same distribution (Box-Muller over Philox uniforms, ``|z| <
5.7`` as ``u >= 1e-7``: the variance moves by < 1e-6), independent per element and per call (one Philox key per
call from :class:`Keys`, the counter the element's position). Off unless ``TRUTH_STORE_KERNEL=1``; checked under
Triton's CPU interpreter (tests/reference/test_truth_store_kernel.py); ``benchmarks/bench_probe_pass.py``
measures it."""
from __future__ import annotations

import os

import torch

#: normals per program: four blocks of BLOCK elements (one Philox call gives four)
BLOCK = 1024
#: rows (sequence x replica) one launch takes (the grid's second axis)
MAX_ROWS = 65535
#: the keys' offset: above every seed of the attention kernels (< 2^32), so no two kernels share a Philox stream
KEY_BASE = 1 << 32


def available(one: torch.Tensor, std: torch.Tensor, rows: int) -> bool:
    """Whether the kernel serves this store: ``TRUTH_STORE_KERNEL=1``, CUDA fp32, at most :data:`MAX_ROWS` rows,
    Triton importable (only then imported: a CPU truth never needs it)."""
    if not (os.environ.get("TRUTH_STORE_KERNEL") == "1" and one.is_cuda and one.dtype == torch.float32
            and std.dtype == torch.float32 and rows <= MAX_ROWS):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class Keys:
    """Philox keys, one per call: the first drawn from ``generator`` when first asked for (one device read per
    probed pass, not per store), then counted up."""

    def __init__(self, generator: torch.Generator | None, device: torch.device):
        self.generator, self.device, self.next = generator, device, None

    def __call__(self) -> int:
        if self.next is None:
            dev = self.generator.device if self.generator is not None else self.device
            self.next = KEY_BASE + int(torch.randint(0, 2 ** 30, (1,), generator=self.generator, device=dev))
        key, self.next = self.next, self.next + 1
        return key


def draw_add(upstream: torch.Tensor | None, std: torch.Tensor, rows: int, dtype: torch.dtype, key: int) -> torch.Tensor:
    """``[rows, *std.shape[1:]]``: ``upstream + std[row // (rows / S)] z`` (``std`` ``[S, ...]``, each sequence's
    for its ``rows / S`` replicas; ``upstream`` ``None`` or any dtype, read as fp32) in ``dtype``."""
    import triton

    from reference_impl.truth._store_triton import store_kernel

    s_ = std.shape[0]
    if rows % s_:
        raise ValueError(f"{rows} rows are not replicas of {s_} sequences")
    std = std.contiguous()
    inner = std[0].numel()
    out = torch.empty(rows, *std.shape[1:], dtype=dtype, device=std.device)
    if upstream is not None:
        upstream = upstream.reshape(out.shape).contiguous()
    grid = (triton.cdiv(inner, 4 * BLOCK), rows)
    store_kernel[grid](upstream if upstream is not None else std, std, out, key, inner, rows // s_,
                       HAS_UP=upstream is not None, BLOCK=BLOCK)
    return out
