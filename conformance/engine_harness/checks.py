"""Named checks on an :class:`~conformance.engine_harness.core.EngineRun`, and the references they use,
computed straight from the checkpoint tensors (never from the engine's prepared tensors).

* dense W4A16: ``y* = ((x * pqs) @ W^T) * max(weight_scale_2) + bias`` (docs/contracts.md section 2), judged by
  :func:`reference_impl.bounds.dense.dense_error_bound`.
* dense W4A4: the activations ``x' = bf16(x * pqs)`` are NVFP4-quantized with the kernel recipe and the
  global encode scale ``1 / max(input_scale)`` (bit-exact, :func:`reference_impl.format.nvfp4.quantize_kernel`),
  ``y* = (q(x') @ W^T) * (max(input_scale) * max(weight_scale_2)) + bias``, evaluated exactly; the same
  dense bound applies with ``x'`` replaced by the exact dequantized codes (``e2m1 * e4m3``: exact in bf16).
* MoE W4A16: :func:`reference_impl.bounds.moe.moe_error_bound` on this rank's experts.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from reference_impl.dense import w4a16_linear_exact
from reference_impl.format.nvfp4 import BLOCK_SIZE, e2m1_decode, e4m3_decode, quantize_kernel, unpack_nibbles

from conformance.interfaces.kernel import DenseLayer
from reference_impl.bounds.dense import dense_error_bound, error_figures
from conformance._framework.checks import check, register_area
from conformance._framework.checks import failing_checks as _failing
from conformance.engine_harness.core import EngineRun, MoECheckpoint

register_area("engine", "test_dense_integration")  # every engine check runs in each integration test


@dataclass(frozen=True)
class EngineCaseRun:
    """One engine case judged: the case, the scenario's run (:class:`EngineRun`) and its checkpoint reference
    ``(exact, bound)``, built only when a check asks for it."""

    case: Any
    engine: EngineRun
    reference: Callable[[], tuple[torch.Tensor, torch.Tensor]]

    @functools.cached_property
    def exact_and_bound(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.reference()


def w4a4_quantized_activations(x: torch.Tensor, ckpt: DenseLayer) -> torch.Tensor:
    """``e2m1 * e4m3`` of the NVFP4-quantized activations, as bf16 (exact: at most 5 significant bits)."""
    xp = x * ckpt.pre_quant_scale if ckpt.pre_quant_scale is not None else x
    global_sf = 1.0 / ckpt.input_scale.float().max()
    packed, sf = quantize_kernel(xp.reshape(-1, xp.shape[-1]), global_sf)
    codes = e2m1_decode(unpack_nibbles(packed)) * e4m3_decode(sf).repeat_interleave(BLOCK_SIZE, dim=-1)
    return codes.to(torch.bfloat16).reshape(xp.shape)


def dense_reference(ckpt: DenseLayer, x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact fp64 ``[..., N]``, per-element bound) for the engine's dense output."""
    k = ckpt.in_features
    if mode == "w4a16":
        exact, mag = w4a16_linear_exact(x, ckpt.weight, ckpt.weight_scale, ckpt.weight_scale_2, ckpt.pre_quant_scale, ckpt.bias)
        return exact, dense_error_bound(exact, mag, k, has_pre_quant_scale=ckpt.pre_quant_scale is not None, bias=ckpt.bias)
    if ckpt.input_scale is None:
        raise ValueError("a W4A4 reference needs the checkpoint's input_scale")
    xq = w4a4_quantized_activations(x, ckpt)
    alpha = (ckpt.input_scale.float().max() * ckpt.weight_scale_2.float().max()).reshape(1)
    exact, mag = w4a16_linear_exact(xq, ckpt.weight, ckpt.weight_scale, alpha, None, ckpt.bias)
    return exact, dense_error_bound(exact, mag, k, has_pre_quant_scale=False, bias=ckpt.bias)


def moe_reference(ckpt: MoECheckpoint, x, topk_ids, topk_weights) -> tuple[torch.Tensor, torch.Tensor]:
    from reference_impl.bounds.moe import moe_error_bound

    b = moe_error_bound(x, topk_ids, topk_weights, ckpt.local_experts())
    return b.exact, b.bound


@check("engine", "output_within_bound")
def output_within_bound(run: EngineCaseRun) -> None:
    """The engine's output (first forward) matches the checkpoint reference within the derived bound."""
    check_output_within_bound(run.engine, *run.exact_and_bound, run.case.id)


@check("engine", "reload_keeps_identity")
def reload_keeps_identity(run: EngineCaseRun) -> None:
    """After a same-shape reload every graph-captured tensor is the same object at the same address."""
    check_reload_keeps_identity(run.engine, run.case.id)


@check("engine", "reload_reproduces_output")
def reload_reproduces_output(run: EngineCaseRun) -> None:
    """Reloading the same checkpoint gives bitwise the same output."""
    check_reload_reproduces_output(run.engine, run.case.id)


def check_output_within_bound(run: EngineRun, exact: torch.Tensor, bound: torch.Tensor, label: str) -> None:
    """:func:`output_within_bound` on an :class:`EngineRun` and its reference (also the A2A prefill's check)."""
    y = run.y
    assert isinstance(y, torch.Tensor) and tuple(y.shape) == tuple(exact.shape), (
        f"{label}: engine output {getattr(y, 'shape', y)} does not have the reference shape {tuple(exact.shape)}"
    )
    assert y.dtype == torch.bfloat16, f"{label}: engine output is {y.dtype}, expected torch.bfloat16"
    fig = error_figures(y, exact, bound)
    assert fig.bound_ratio <= 1.0, (
        f"{label}: engine output outside the derived bound of the checkpoint reference: "
        f"max |y - y*| / bound = {fig.bound_ratio:.4g} at {fig.worst_index} (got {fig.worst_got!r}, "
        f"exact {fig.worst_exact!r}); rel_l2 {fig.rel_l2:.3g}, cosine {fig.cosine:.6f}"
    )


def check_reload_keeps_identity(run: EngineRun, label: str) -> None:
    """After a same-shape reload every graph-captured tensor is the same object at the same address."""
    moved = []
    for name, old in run.before.items():
        new = run.after.get(name)
        if new is None:
            moved.append(f"{name}: gone after reload")
        elif (new.obj_id, new.data_ptr) != (old.obj_id, old.data_ptr):
            what = "rebound to a new object" if new.obj_id != old.obj_id else "same object, new storage"
            moved.append(f"{name}: {what} (shape {old.shape} -> {new.shape}, {old.dtype} -> {new.dtype})")
    assert not moved, f"{label}: a same-shape reload moved graph-captured tensors: " + "; ".join(moved)


def check_reload_reproduces_output(run: EngineRun, label: str) -> None:
    """Reloading the same checkpoint gives bitwise the same output."""
    same = torch.equal(run.y.nan_to_num(), run.y_reload.nan_to_num()) and torch.equal(run.y.isnan(), run.y_reload.isnan())
    assert same, (
        f"{label}: output after reload differs from before: max |diff| = "
        f"{(run.y.float() - run.y_reload.float()).abs().nan_to_num().max().item():.4g}"
    )


# ----------------------------------------------------------------------------------------- verdicts
#: ``scenario_completes`` (the engine or the emulator raised) and the registered checks, by name
CHECKS = ("scenario_completes", "output_within_bound", "reload_keeps_identity", "reload_reproduces_output")


def failing_checks(adapter, case, platform=None) -> dict[str, str]:
    """Run ``case`` (an ``EngineDenseCase`` or ``EngineMoECase``) through ``adapter`` and return the
    failing checks by name (empty: the engine conforms). ``scenario_completes`` fails when the engine or
    the emulator raises (e.g. the emulator rejecting an argument FlashInfer would reject).

    ``platform`` (a :class:`~conformance.adapters.flashinfer.platform.FlashInferPlatform`) selects the ``b200``
    variant: the engine's layer code calls that platform's FlashInfer (the real kernels on a B200, the emulator
    under ``--flashinfer-emulated``) on the ``b200`` tier's device. ``None``: the emulator on the CPU."""
    from conformance._framework.dense_layers import build_activations, build_layer
    from conformance.engine_harness.cases import EngineDenseCase, build_moe_checkpoint, build_moe_inputs
    from conformance.engine_harness.core import run_scenario

    if isinstance(case, EngineDenseCase):
        ckpt, x = build_layer(case.dense, "cpu"), build_activations(case.dense, "cpu")
        kind, args = "dense", (x,)
        reference = lambda: dense_reference(ckpt, x, case.mode)  # noqa: E731
    else:
        ckpt = build_moe_checkpoint(case)
        x, ids, wts = build_moe_inputs(case)
        kind, args = "moe", (x, ids, wts)
        reference = lambda: moe_reference(ckpt, x, ids, wts)  # noqa: E731
    where = {}
    if platform is not None:
        from conformance._framework.tiers import device_for_tier

        where = dict(modules=platform.module_tree(), device=device_for_tier("b200"))
    try:
        run = run_scenario(adapter, kind, case.mode, ckpt, args, **where)
    except Exception as exc:  # noqa: BLE001 - any engine/emulator error fails the scenario, with its text
        return {"scenario_completes": f"{type(exc).__name__}: {exc}"}
    return _failing("engine", EngineCaseRun(case, run, reference), adapter)
