"""Layout bugs planted in the FlashInfer adapter (``conformance/adapters/flashinfer/kernel*.py``), as a pytest plugin for
the emulated b200 tier's self-test (tests/adapters/test_flashinfer_emulated_tier.py): load it with
``-p tests.adapters.flashinfer_mutants`` and name the bugs in ``$NVFP4_FLASHINFER_ADAPTER_MUTANTS``
(comma-separated). Each is a classic integration slip that gives the kernel well-formed tensors of the right
shapes and sizes, so only the numbers can catch it.

* ``w13-gate-up``: the MoE W13 handed to the 64-row interleave as ``[gate; up]`` although the kernel reads
  ``[up; gate]`` (the kernel then applies the activation to the up projection).
* ``dense-linear-scales``: the dense block scales padded to the 128x4 tile size but left in linear order
  (same byte count as the swizzled layout, so no size check fires).
"""
from __future__ import annotations

import os

import torch

MUTANTS_ENV_VAR = "NVFP4_FLASHINFER_ADAPTER_MUTANTS"


def _gate_up_as_up_gate(original):
    def to_cutedsl_w13(w13: torch.Tensor, chunk_rows: int = 64) -> torch.Tensor:
        half = w13.shape[-2] // 2
        swapped = torch.cat((w13[..., half:, :], w13[..., :half, :]), dim=-2)  # [gate; up] -> [up; gate]
        return original(swapped, chunk_rows)  # ... which the helper then treats as [gate; up]

    return to_cutedsl_w13


def _padded_linear_scales(scales: torch.Tensor) -> torch.Tensor:
    from reference_impl.format.nvfp4 import swizzled_shape

    *lead, rows, cols = scales.shape
    pr, pc = swizzled_shape(rows, cols)
    out = torch.zeros(*lead, pr, pc, dtype=torch.uint8, device=scales.device)
    out[..., :rows, :cols] = scales.view(torch.uint8)
    return out.view(scales.dtype)


def pytest_configure(config) -> None:
    from conformance.adapters.flashinfer import kernel as flashinfer, moe as flashinfer_moe

    planted = [m.strip() for m in os.environ.get(MUTANTS_ENV_VAR, "").split(",") if m.strip()]
    for mutant in planted:
        if mutant == "w13-gate-up":
            flashinfer_moe.to_cutedsl_w13 = _gate_up_as_up_gate(flashinfer_moe.to_cutedsl_w13)
        elif mutant == "dense-linear-scales":
            flashinfer.swizzle_128x4 = _padded_linear_scales
        else:
            raise ValueError(f"unknown FlashInfer adapter mutant {mutant!r} in ${MUTANTS_ENV_VAR}")
