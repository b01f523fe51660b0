"""Engine-harness cases for the FlashInfer-A2A eager-prefill path of the flashinfer_cutedsl MoE runner.

With ``--moe-a2a-backend flashinfer``, eager prefill does not go through the A2A dispatch: an all-gather hands
the runner a *standard* dispatch output, and the runner must return a *standard* combine input (the
dispatcher reduce-scatters it). The scenario builds the engine's real MoE layer, loads the checkpoint through
its loaders and post-processes it (as :func:`~conformance.engine_harness.core.run_scenario` does), then gives
the layer's quant method a runner for the FlashInfer A2A backend and calls its ``apply`` with a standard
dispatch output of BF16 hidden states (BF16 dispatch: what W4A16 requires, and W4A4 without NVFP4 dispatch).

Checks (named, like :mod:`.checks`):

* ``standard_combine``: the result is the engine's standard combine input, holding the kernel's output.
* ``activations``: W4A16: the kernel receives the BF16 hidden states unchanged, ``x_sf``/``fc2_input_scale``/
  ``per_token_scale`` None. W4A4: the kernel receives NVFP4 activations bit-identical to the kernel recipe
  applied with the CuTe DSL scalar global scale ``1 / max_e(w13 input_scale)`` (computed here from the
  checkpoint's input scales), linear ``[T, H/16]`` E4M3 scales, and an ``fc2_input_scale``.
* ``output_within_bound`` (W4A16 only): the MoE output against the checkpoint reference within the derived
  bound (:func:`reference_impl.bounds.moe.moe_error_bound`). The emulator models the W4A16 MoE kernel only, so
  the W4A4 kernel call is recorded and answered with zeros: for W4A4 this scenario checks what reaches the
  kernel, not its numbers.

An engine provides the scenario as
``adapter.flashinfer_a2a_prefill(ckpt, mode, x, topk_ids, topk_weights, modules=...)`` returning a
:class:`~conformance.interfaces.layer_code.PrefillCombine` (the interface's optional
:attr:`~conformance.interfaces.layer_code.LayerCodeEngine.flashinfer_a2a_prefill`; SGLang's:
:mod:`conformance.adapters.sglang.a2a_prefill`); without it the cases skip with that reason. The harness passes
``modules``, the emulator tree of :func:`recording_modules`, and reads what reached the kernel from its recording
(:class:`PrefillObservation`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from reference_impl.format.nvfp4 import quantize_kernel

from conformance.engine_harness.cases import EngineMoECase, build_moe_checkpoint, build_moe_inputs
from conformance.engine_harness.checks import check_output_within_bound, moe_reference
from conformance.engine_harness.core import EngineRun, recording_module_tree
from conformance.interfaces.layer_code import PrefillCombine


@dataclass(frozen=True)
class PrefillObservation:
    """What the prefill scenario saw: the combine input's kind (``standard``/``flashinfer``/type name), the
    tensor it holds (both from the engine's :class:`~conformance.interfaces.layer_code.PrefillCombine`), the
    kernel call's keyword arguments (tensors as passed) and the kernel's output (both recorded by the harness)."""

    combine: str
    combined: Any
    kernel_kwargs: dict[str, Any]
    kernel_output: torch.Tensor


def recording_wrapper_class(base: type, runs: list) -> type:
    """A subclass of the emulator's ``CuteDslMoEWrapper`` that records each ``run``'s keyword arguments; W4A4
    runs (not modelled by the emulator) are checked for the packed-input contract and answered with zeros."""

    class RecordingCuteDslMoEWrapper(base):
        def run(self, x, x_sf=None, token_selected_experts=None, token_final_scales=None, *args, **kwargs):
            kw = {"x": x, "x_sf": x_sf, "token_selected_experts": token_selected_experts,
                  "token_final_scales": token_final_scales, **kwargs}
            if self.quant_mode == "w4a16":
                out = super().run(x, x_sf, token_selected_experts, token_final_scales, *args, **kwargs)
            else:
                if x.dtype is not torch.uint8 or x_sf is None:
                    raise TypeError(f"quant_mode={self.quant_mode!r} requires packed uint8 input and x_sf")
                out = torch.zeros(x.shape[0], x.shape[1] * 2, dtype=torch.bfloat16)
            runs.append((kw, out))
            return out

    return RecordingCuteDslMoEWrapper


def recording_modules(calls: list, runs: list) -> dict:
    """The emulator's module tree (entry points recorded into ``calls``) with the recording wrapper class."""
    modules = recording_module_tree(calls)
    for mod in modules.values():
        base = getattr(mod, "CuteDslMoEWrapper", None)
        if isinstance(base, type):
            mod.CuteDslMoEWrapper = recording_wrapper_class(base, runs)
    return modules


def w4a4_expected_activations(case: EngineMoECase, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, linear e4m3 scales) the CuTe DSL W4A4 runner must hand the kernel: the kernel recipe with the
    scalar global encode scale ``1 / max`` of the checkpoint's gate/up input scales over *all* experts (the
    runner quantizes before routing, so one scale serves every expert)."""
    ckpt = build_moe_checkpoint(case)
    input_scale = torch.stack([torch.maximum(g[3], u[3]) for g, u in zip(ckpt.gate, ckpt.up)]).max().float()
    return quantize_kernel(x, 1.0 / input_scale)


def prefill_runner(adapter):
    """The adapter's FlashInfer-A2A prefill scenario, or ``None`` when it has none."""
    own = getattr(adapter, "flashinfer_a2a_prefill", None)
    return None if own is None else (lambda _adapter, *args, **kwargs: own(*args, **kwargs))


def observe_prefill(runner, adapter, ckpt, mode, x: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor) -> PrefillObservation:
    """Run the engine's prefill scenario under the recording emulator tree; what it returned and what the
    kernel received (exactly one kernel run, else ``AssertionError``)."""
    calls: list = []
    runs: list = []
    combine: PrefillCombine = runner(adapter, ckpt, mode, x, ids, weights, modules=recording_modules(calls, runs))
    if len(runs) != 1:
        raise AssertionError(f"the CuTe DSL kernel ran {len(runs)} times in one prefill")
    kwargs, output = runs[0]
    return PrefillObservation(combine.combine, combine.combined, kwargs, output)


def prefill_failures(adapter, case: EngineMoECase) -> dict[str, str]:
    """Run the FlashInfer-A2A prefill scenario for ``case`` through ``adapter``; failing checks by name."""
    runner = prefill_runner(adapter)
    if runner is None:
        raise LookupError(f"engine adapter {getattr(adapter, 'name', adapter)!r} has no FlashInfer-A2A prefill scenario")
    ckpt = build_moe_checkpoint(case)
    x, ids, weights = build_moe_inputs(case)
    try:
        seen = observe_prefill(runner, adapter, ckpt, case.mode, x, ids, weights)
    except Exception as exc:  # noqa: BLE001 - an engine/emulator error fails the scenario, with its text
        return {"scenario_completes": f"{type(exc).__name__}: {exc}"}
    failures: dict[str, str] = {}
    if seen.combine != "standard":
        failures["standard_combine"] = f"{case.id}: prefill returned a {seen.combine} combine input, not a standard one"
    elif seen.combined is not seen.kernel_output:
        failures["standard_combine"] = f"{case.id}: the standard combine input does not hold the kernel's output"
    kw = seen.kernel_kwargs
    problems = []
    if case.mode == "w4a16":
        if kw["x"] is not x and not (kw["x"].dtype == x.dtype and torch.equal(kw["x"], x)):
            problems.append(f"x is {kw['x'].dtype} {tuple(kw['x'].shape)}, not the BF16 hidden states")
        problems += [f"{k} passed under W4A16" for k in ("x_sf", "fc2_input_scale", "per_token_scale")
                     if kw.get(k) is not None]
    else:
        packed, sf = w4a4_expected_activations(case, x)
        if kw["x"].dtype is not torch.uint8 or not torch.equal(kw["x"].reshape(packed.shape), packed):
            problems.append("x is not the kernel-recipe NVFP4 quantization of the hidden states with 1/max(input_scale)")
        got_sf = kw.get("x_sf")
        if got_sf is None or tuple(got_sf.shape) != tuple(sf.shape) or not torch.equal(
                got_sf.view(torch.uint8), sf.view(torch.uint8)):
            problems.append(f"x_sf is not the linear [T, H/16] E4M3 block scales (got "
                            f"{None if got_sf is None else (got_sf.dtype, tuple(got_sf.shape))})")
        if kw.get("fc2_input_scale") is None:
            problems.append("no fc2_input_scale under W4A4")
        if kw.get("per_token_scale") is not None:
            problems.append("per_token_scale passed without per-token activation")
    if problems:
        failures["activations"] = f"{case.id}: " + "; ".join(problems)
    if case.mode == "w4a16":
        exact, bound = moe_reference(ckpt, x, ids, weights)
        run = EngineRun("moe", case.mode, seen.kernel_output, seen.kernel_output, {}, {})
        try:
            check_output_within_bound(run, exact, bound, case.id)
        except AssertionError as exc:
            failures["output_within_bound"] = str(exc)
    return failures


PREFILL_CASES = [
    EngineMoECase("moe-w4a4-flashinfer-a2a-prefill", num_experts=4, hidden=128, intermediate=128, tokens=9, top_k=2,
                  mode="w4a4"),
    EngineMoECase("moe-w4a16-flashinfer-a2a-prefill", num_experts=4, hidden=128, intermediate=128, tokens=9, top_k=2),
    EngineMoECase("moe-w4a4-flashinfer-a2a-prefill-ep-rank1-of-2", num_experts=4, hidden=128, intermediate=128,
                  tokens=11, top_k=2, ep_size=2, ep_rank=1, mode="w4a4"),
]
