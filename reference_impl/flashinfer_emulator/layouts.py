"""Scale-factor layouts the W4A16 entry points exchange (FlashInfer 0.7.4 ``flashinfer.cute_dsl.utils``
and ``flashinfer.quantization``), written from the layout definitions in docs/contracts.md section 1.

* 128x4 swizzle: 512-byte atoms of 128 rows x 4 scale columns; see :func:`reference_impl.format.nvfp4.swizzle_128x4`.
* MMA layout: a *view* of the swizzled bytes of ``num_groups`` matrices, logical shape
  ``(32, 4, m_tiles, 4, k_tiles, num_groups)``, physical order ``(num_groups, m_tiles, k_tiles, 32, 4, 4)``.
  A kernel reading it through ``data_ptr()`` sees exactly the swizzled bytes, expert after expert.
"""
from __future__ import annotations

import torch

from reference_impl.format.nvfp4 import swizzle_128x4, unswizzle_128x4


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def get_mma_sf_shape(m: int, k: int, num_groups: int = 1, sf_vec_size: int = 16) -> tuple[int, ...]:
    """Logical shape of the MMA-layout view: ``(32, 4, m_tiles, 4, k_tiles, num_groups)``."""
    return (32, 4, _ceil_div(m, 128), 4, _ceil_div(_ceil_div(k, sf_vec_size), 4), num_groups)


def convert_sf_to_mma_layout(
    sf: torch.Tensor, m: int, k: int, num_groups: int = 1, sf_vec_size: int = 16
) -> torch.Tensor:
    """Swizzled scales (any shape holding exactly the padded element count) -> the strided 6-D MMA view.
    Raises ``ValueError`` when the element count is not the padded 128x4 size, as FlashInfer does."""
    m_tiles = _ceil_div(m, 128)
    k_tiles = _ceil_div(_ceil_div(k, sf_vec_size), 4)
    expected = num_groups * m_tiles * k_tiles * 32 * 4 * 4
    if sf.numel() != expected:
        raise ValueError(
            f"Scale factor tensor has {sf.numel()} elements, "
            f"expected {expected} for m={m}, k={k}, num_groups={num_groups}"
        )
    return sf.view(num_groups, m_tiles, k_tiles, 32, 4, 4).permute(3, 4, 1, 5, 2, 0)


def convert_sf_from_mma_layout(
    sf_6d: torch.Tensor, m: int, k: int, num_groups: int = 1, sf_vec_size: int = 16
) -> torch.Tensor:
    """Inverse of :func:`convert_sf_to_mma_layout`: ``(num_groups * M_pad, K_sf_pad)`` swizzled bytes."""
    m_tiles = _ceil_div(m, 128)
    k_tiles = _ceil_div(_ceil_div(k, sf_vec_size), 4)
    storage = sf_6d.permute(5, 2, 4, 0, 1, 3).contiguous()
    return storage.reshape(num_groups * m_tiles * 128, k_tiles * 4)


def block_scale_interleave(unswizzled_sf: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Linear ``[M, K_sf]`` or ``[E, M, K_sf]`` uint8/e4m3 scales -> flat swizzled byte buffer (FlashInfer's
    ``block_scale_interleave``: 1-D, ``E * padded`` bytes, same dtype as the input)."""
    if unswizzled_sf.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise TypeError(f"block_scale_interleave expects uint8 or float8_e4m3fn scales, got {unswizzled_sf.dtype}")
    swizzled = swizzle_128x4(unswizzled_sf).reshape(-1)
    if out is not None:
        if out.shape != swizzled.shape or out.dtype != swizzled.dtype:
            raise ValueError(
                f"out must be a tensor of shape {tuple(swizzled.shape)}, dtype {swizzled.dtype}; "
                f"got {tuple(out.shape)}, {out.dtype}"
            )
        out.copy_(swizzled)
        return out
    return swizzled


def raw_bytes(t: torch.Tensor, count: int, what: str) -> torch.Tensor:
    """The ``count`` bytes a kernel reads from ``t.data_ptr()`` on (contiguous order from the storage offset),
    whatever view ``t`` is. The emulator refuses to read past the storage (the real kernel would read
    out of bounds: undefined behaviour, so raising is the only defined outcome)."""
    itemsize = t.element_size()
    start = t.storage_offset() * itemsize
    storage = t.untyped_storage()
    if start + count > storage.nbytes():
        raise ValueError(
            f"{what}: the kernel reads {count} bytes from data_ptr(), but only {storage.nbytes() - start} "
            f"are allocated (flashinfer_emulator refuses the out-of-bounds read the real kernel would do)"
        )
    flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))
    return flat[start : start + count]


def linear_scales_from_swizzled_bytes(swizzled: torch.Tensor, rows: int, scale_cols: int) -> torch.Tensor:
    """Swizzled bytes of one matrix (or of ``E`` stacked ones) -> linear ``[rows, scale_cols]`` (or
    ``[E, rows, scale_cols]``) e4m3 scales."""
    pr = _ceil_div(rows, 128) * 128
    pc = _ceil_div(scale_cols, 4) * 4
    lead = swizzled.numel() // (pr * pc)
    raw = swizzled.contiguous().view(torch.uint8).reshape(lead, pr, pc)
    if lead * pr * pc != swizzled.numel():
        raise ValueError(f"{swizzled.numel()} swizzled scale bytes are not a whole number of {pr}x{pc} matrices")
    lin = unswizzle_128x4(raw, rows, scale_cols).view(torch.float8_e4m3fn)
    return lin[0] if lead == 1 else lin
