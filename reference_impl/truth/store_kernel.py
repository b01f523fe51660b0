"""A probed store's draw and add in one Triton kernel (CUDA, fp32 probed passes): ``upstream + std z`` with ``z``
standard normals drawn in the kernel (Triton's Philox), each sequence's ``std`` read for its replicas. The eager
path (:meth:`reference_impl.truth.probe_draws.Probe._tangent`) writes the normals to memory, then reads them, the
upstream tangent and the broadcast ``std`` to write the sum: four passes over a replicated tensor where this
makes two, the largest elementwise cost of a probed pass (the MLP's ``[S, K, T, 14336]`` stores, a long
prefill's ``[S, K, H, Tq, Tk]`` scores and probabilities).

The draws are not the eager path's numbers: the same distribution (Box-Muller over Philox uniforms, ``|z| <
5.7`` as ``u >= 1e-7``: the variance moves by < 1e-6), independent per element and per call (one Philox key per
call from :class:`Keys`, the counter the element's position). On by default on CUDA (``TRUTH_STORE_KERNEL=0``
turns it off): on one H100 (docs/truth.md) `standard`'s truth on the 8B shape took 163.2 s with it against 173.2 s
without, in the same session, at 2.3 GiB less peak memory; its draws passed the same checks as under Triton's CPU
interpreter (tests/reference/test_truth_store_kernel.py). (Those figures are the kernel's first version, one
program per replica row; it now reads a sequence's ``std`` once for all its replicas, the same numbers bit for
bit, not yet timed on a GPU.) A kernel that fails to launch (a Triton that cannot
compile it) warns once and leaves the eager path for the rest of the process."""
from __future__ import annotations

import os
import warnings

import torch

#: normals per program: four blocks of BLOCK elements (one Philox call gives four)
BLOCK = 1024
#: sequences one launch takes (the grid's second axis; a program loops over a sequence's replicas)
MAX_SEQUENCES = 65535
#: the keys' offset (the first key of a pass is KEY_BASE plus a draw below 2^30)
KEY_BASE = 1 << 32


_broken: list[str] = []  # why the kernel failed to launch in this process (then never tried again)


def available(one: torch.Tensor, std: torch.Tensor) -> bool:
    """Whether the kernel serves a store of ``one`` with ``std`` (``[S, ...]``, per sequence): not turned off
    (``TRUTH_STORE_KERNEL=0``), CUDA fp32, at most :data:`MAX_SEQUENCES` sequences, Triton importable (only then
    imported: a CPU truth never needs it), no failed launch before."""
    if not (os.environ.get("TRUTH_STORE_KERNEL", "1") != "0" and one.is_cuda and one.dtype == torch.float32
            and std.dtype == torch.float32 and std.shape[0] <= MAX_SEQUENCES and not _broken):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class Keys:
    """Philox keys, one per call: the first drawn from ``generator`` when first asked for (one device read per
    probed pass, not per store), then counted up."""

    def __init__(self, generator: torch.Generator | None):
        self.generator, self.next = generator, None

    def __call__(self, device: torch.device, count: int = 1) -> int:
        """The next key, or the first of the next ``count`` consecutive ones (a kernel whose streams are
        ``key + i``); the first drawn on ``generator``'s device, or on ``device`` (the default generator's)."""
        if self.next is None:
            dev = self.generator.device if self.generator is not None else device
            self.next = KEY_BASE + int(torch.randint(0, 2 ** 30, (1,), generator=self.generator, device=dev))
        key, self.next = self.next, self.next + count
        return key


def try_draw_add(upstream: torch.Tensor | None, std: torch.Tensor, rows: int, dtype: torch.dtype,
                 key: int) -> torch.Tensor | None:
    """:func:`draw_add`, or None where the kernel fails to launch (warned once; the caller draws eagerly)."""
    return _guarded(draw_add, upstream, std, rows, dtype, key)


def _guarded(launch, *args):
    """``launch(*args)``, or None where a kernel fails to launch: warned once, and no kernel of this module is
    tried again in the process (:func:`available`); a ValueError (a caller's mistake) is raised."""
    try:
        return launch(*args)
    except ValueError:
        raise
    except Exception as exc:  # Triton's compile and launch errors have no common type
        _broken.append(f"{type(exc).__name__}: {exc}")
        warnings.warn(f"the truth's store kernel failed to launch, eager draws from now on: {_broken[0]}",
                      RuntimeWarning, stacklevel=3)
        return None


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
    grid = (triton.cdiv(inner, 4 * BLOCK), s_)
    store_kernel[grid](upstream if upstream is not None else std, std, out, key, inner, rows // s_,
                       HAS_UP=upstream is not None, BLOCK=BLOCK)
    return out


#: a softmax row tile's elements (replicas x columns): its registers
SOFTMAX_TILE = 2048


def softmax_available(scores: torch.Tensor) -> bool:
    """Whether :func:`softmax_stores` serves a probed softmax: turned on (``TRUTH_SOFTMAX_KERNEL=1``: off by
    default until measured on a GPU) and the store kernel's conditions."""
    return os.environ.get("TRUTH_SOFTMAX_KERNEL") == "1" and available(scores, scores)


def softmax_stores(st: torch.Tensor, p: torch.Tensor, std: torch.Tensor, u_round: float,
                   key: int) -> torch.Tensor | None:
    """A probed softmax's two stores in one pass over the replicas' ``T^2`` tangents: with ``st [S, K, ...]``
    the scores' tangents (overwritten), ``p`` and ``std`` ``[S, ...]`` the probabilities and the scores' store's
    standard deviation, ``st <- p (st + std z1) + u_round p z2`` and the returned ``sum_j p (st + std z1)`` over
    the last axis (``[S, K, ..., 1]``). What the eager path makes in five passes (the scores' store, ``p t``, its
    sum, the probabilities' store). None where the kernel fails to launch (warned once, as :func:`try_draw_add`)."""
    return _guarded(_softmax_stores, st, p, std, u_round, key)


def _softmax_stores(st, p, std, u_round, key):
    import triton

    from reference_impl.truth._store_triton import softmax_stores_kernel

    s_, k = st.shape[:2]
    if p.shape != std.shape or p.shape != (s_, *st.shape[2:]) or not st.is_contiguous():
        raise ValueError(f"tangents {tuple(st.shape)} (contiguous) against probabilities {tuple(p.shape)} and "
                         f"std {tuple(std.shape)}")
    tk = st.shape[-1]
    rows_per_seq = p[0].numel() // tk
    p, std = p.contiguous(), std.contiguous()
    mean = torch.empty(*st.shape[:-1], 1, dtype=st.dtype, device=st.device)
    kp = triton.next_power_of_2(k)
    block = max(16, SOFTMAX_TILE // kp)
    softmax_stores_kernel[(s_ * rows_per_seq,)](st, p, std, mean, key, tk, rows_per_seq, k, u_round, KP=kp,
                                                BLOCK=block)
    return mean
