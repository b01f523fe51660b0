"""The W4A16 fused-MoE checks: plain functions raising ``AssertionError`` with a readable report that starts
with the check's name in brackets (``[moe_within_bound] ...``), so self-tests can tell which check caught
a broken backend (``tests/moe/test_moe_mutants.py``).

A case runs on every expert-parallel rank: rank ``r`` gets its slice of the experts
(:func:`conformance.moe.cases.rank_slice`) and the full batch of tokens and global ids, and must return
the contribution of its own experts only.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from reference_impl.moe import fused_moe_exact

from conformance.interfaces.kernel import Backend, MoEExperts
from conformance._framework.checks import check, register_area
from conformance._framework.checks import failing_checks as _failing
from reference_impl.bounds.dense import FLASHINFER_MAX_REL_L2, FLASHINFER_MIN_COSINE
from reference_impl.bounds.moe import ErrorFigures, MoEBound, error_figures, moe_error_bound
from conformance.moe.cases import MoECase, build_global_experts, build_inputs, rank_slice

DETERMINISM_REPEATS = 3
register_area("moe", "test_moe_matches_reference")
#: Multiplier applied to checkpoint input scales by :func:`check_moe_input_scales_ignored`.
INPUT_SCALE_PERTURBATION = 7.25


@dataclass
class MoERun:
    """One case through one backend: inputs, each rank's experts, prepared state and output."""

    case: MoECase
    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    ranks: list[MoEExperts]
    prepared: list[Any]
    outputs: list[Any]
    _bounds: list[MoEBound] | None = field(default=None, repr=False)


def run_moe_case(backend: Backend, case: MoECase, device: torch.device | str | None = None) -> MoERun:
    """Build the case on its device, prepare every rank's experts once and run each rank once."""
    device = torch.device(device) if device is not None else case.device
    full = build_global_experts(case, device)
    x, ids, w = build_inputs(case, device)
    ranks = [rank_slice(full, r, case.ep_size) for r in range(case.ep_size)] if case.ep_size > 1 else [full]
    prepared, outputs = [], []
    for experts in ranks:
        p = backend.prepare_moe(experts, device)
        prepared.append(p)
        outputs.append(backend.run_moe(p, x, ids, w))
    return MoERun(case, x, ids, w, ranks, prepared, outputs)


def rank_bounds(run: MoERun) -> list[MoEBound]:
    """Exact output and bound per rank (computed once per run)."""
    if run._bounds is None:
        run._bounds = [moe_error_bound(run.x, run.topk_ids, run.topk_weights, r) for r in run.ranks]
    return run._bounds


def describe_inputs(run: MoERun, rank: int | None = None) -> str:
    c, ex = run.case, run.ranks[rank or 0]
    ids = run.topk_ids.reshape(-1).long()
    counts = torch.bincount(ids[ids >= 0], minlength=c.experts).tolist()  # -1 (skipped slots) not counted
    parts = [
        f"case {c!r}",
        f"x {tuple(run.x.shape)} {run.x.dtype} on {run.x.device}; topk_ids {tuple(run.topk_ids.shape)} "
        f"{run.topk_ids.dtype}; topk_weights {tuple(run.topk_weights.shape)} {run.topk_weights.dtype}",
        f"tokens per global expert: {counts if len(counts) <= 16 else counts[:8] + ['...'] + counts[-8:]}"
        f"{f', {int((ids < 0).sum())} skipped (-1) slots' if bool((ids < 0).any()) else ''}",
        f"rank {rank or 0}/{c.ep_size}: local experts [{ex.ep_rank * ex.num_local_experts}, "
        f"{(ex.ep_rank + 1) * ex.num_local_experts}), activation {ex.activation} {ex.activation_params}",
        f"w13 {tuple(ex.w13.shape)} halves [gate; up], w13_scale_2[0] {ex.w13_scale_2[0].tolist()} (gate, up), "
        f"input scales {'present (neutral under W4A16)' if ex.w13_input_scale is not None else 'absent'}",
        f"rebuild: conformance.moe.cases.build_global_experts/build_inputs(case) (seed {c.seed})",
    ]
    return "\n  ".join(parts)


def _fail(check: str, message: str, run: MoERun, rank: int | None = None) -> AssertionError:
    return AssertionError(f"[{check}] {message}\n  {describe_inputs(run, rank)}")


def _worst_report(fig: ErrorFigures) -> str:
    return (
        f"worst element (token, column) {fig.worst_index}: got {fig.worst_got!r}, exact {fig.worst_exact!r}, "
        f"bound {fig.worst_bound!r} -> |error| / bound = {fig.bound_ratio:.4g}; rel_l2 {fig.rel_l2:.3e}, "
        f"cosine {fig.cosine:.6f}"
    )


@check("moe", "moe_output_contract")
def check_moe_output_contract(run: MoERun) -> None:
    """Each rank returns a bfloat16 ``[T, H]`` tensor on the input's device."""
    t, h = run.x.shape
    for r, y in enumerate(run.outputs):
        if not isinstance(y, torch.Tensor):
            raise _fail("moe_output_contract", f"rank {r} returned {type(y).__name__}, not a tensor", run, r)
        if y.dtype != torch.bfloat16 or tuple(y.shape) != (t, h) or y.device != run.x.device:
            raise _fail(
                "moe_output_contract",
                f"rank {r} returned {y.dtype} {tuple(y.shape)} on {y.device}; expected bfloat16 ({t}, {h}) on {run.x.device}",
                run, r,
            )


@check("moe", "moe_within_bound")
def check_moe_within_bound(run: MoERun, record: Callable[[ErrorFigures], None] | None = None) -> ErrorFigures:
    """Every rank's output within the derived per-element bound of its exact value
    (:func:`reference_impl.bounds.moe.moe_error_bound`). Returns the figures of the worst rank; ``record``
    receives each rank's figures before its assertion (so a failing case's report shows them)."""
    check_moe_output_contract(run)
    worst = None
    for r, (y, ref) in enumerate(zip(run.outputs, rank_bounds(run))):
        fig = error_figures(y, ref.exact, ref.bound)
        if record is not None and (worst is None or fig.bound_ratio > worst.bound_ratio):
            record(fig)
        if not fig.bound_ratio <= 1.0:
            raise _fail("moe_within_bound", f"rank {r}: {_worst_report(fig)}", run, r)
        if worst is None or fig.bound_ratio > worst.bound_ratio:
            worst = fig
    return worst


@check("moe", "moe_summary_figures")
def check_moe_summary_figures(run: MoERun, fig: ErrorFigures | None = None) -> None:
    """Relative L2 < 2e-2 and cosine > 0.999: the acceptance of FlashInfer's *dense* W4A16 GEMM test
    (``tests/gemm/test_mm_bf16_fp4.py``, ``_assert_close_to_reference``), applied here to the MoE output as a
    summary threshold; FlashInfer's own MoE tests use a different, much looser criterion (``check_accuracy`` in
    ``tests/moe/utils.py``: >= 97 % of elements within ``max(0.05, 1.5 std)`` absolute or 50 % relative of a
    reference on the *unquantized* weights; see docs/moe.md). Looser than the bound at small sizes, it carries
    the rejection of structural bugs at real sizes, where the worst-case bound exceeds ``|y|``. ``fig``: the
    figures of :func:`check_moe_within_bound`, if at hand."""
    fig = fig or check_moe_within_bound(run)
    if not (fig.rel_l2 < FLASHINFER_MAX_REL_L2 and fig.cosine > FLASHINFER_MIN_COSINE):
        raise _fail("moe_summary_figures", f"rel_l2 {fig.rel_l2:.3e} (< {FLASHINFER_MAX_REL_L2}), cosine "
                    f"{fig.cosine:.6f} (> {FLASHINFER_MIN_COSINE})", run)


@check("moe", "moe_ep_sum", test="test_moe_expert_parallel_sum", applies_to=lambda case: case.ep_size > 1)
def check_moe_ep_sum(run: MoERun) -> ErrorFigures:
    """Expert parallel: the sum over ranks (in fp64) equals the full layer's exact output within the sum of
    the ranks' bounds, so no expert is counted twice or missed and other ranks' tokens add nothing."""
    refs = rank_bounds(run)
    total = sum(y.double() for y in run.outputs)
    full = build_global_experts(run.case, run.x.device)
    exact_full = fused_moe_exact(run.x, run.topk_ids, run.topk_weights, full)
    fig = error_figures(total, exact_full, sum(ref.bound for ref in refs))
    if not fig.bound_ratio <= 1.0:
        raise _fail("moe_ep_sum", f"sum over {run.case.ep_size} ranks vs the full layer: {_worst_report(fig)}", run)
    return fig


#: Rows the second batch of :func:`check_moe_prepared_reuse` is rolled by.
REUSE_ROLL = 1


@check("moe", "moe_prepared_reuse", test="test_moe_prepared_reuse", own_run=True)
def check_moe_prepared_reuse(run: MoERun, backend: Backend) -> ErrorFigures:
    """A prepared layer serves many batches: ``run_moe`` on the same prepared experts with a second batch -- the
    case's tokens rolled by :data:`REUSE_ROLL` rows, ids and weights with them -- is within the bound of the rolled
    exact output. Rows are independent (a token's exact value and bound depend on its own x, ids and weights
    only), so rolling the inputs rolls the exact value and the bound: no new truth is computed and the tolerance
    is the derived bound itself (no false failures beyond :func:`check_moe_within_bound`'s). Catches state carried
    from one call to the next, e.g. a persistent output workspace in which the rows of tokens with no local
    expert (all slots remote or ``-1``) are skipped and keep the previous call's values: on a fresh workspace the
    first call is right. Run last on its run (a backend may legally return a buffer it reuses)."""
    worst = None
    for r, (p, ref) in enumerate(zip(run.prepared, rank_bounds(run))):
        shifted = [t.roll(REUSE_ROLL, 0) for t in (run.x, run.topk_ids, run.topk_weights)]
        y = backend.run_moe(p, *shifted)
        if not isinstance(y, torch.Tensor) or y.dtype != torch.bfloat16 or tuple(y.shape) != tuple(run.x.shape):
            raise _fail("moe_prepared_reuse", f"rank {r}: second call returned "
                        f"{getattr(y, 'dtype', type(y).__name__)} {tuple(getattr(y, 'shape', ()))}", run, r)
        fig = error_figures(y, ref.exact.roll(REUSE_ROLL, 0), ref.bound.roll(REUSE_ROLL, 0))
        if not fig.bound_ratio <= 1.0:
            raise _fail("moe_prepared_reuse", f"rank {r}, second batch (tokens rolled by {REUSE_ROLL}) on the same "
                        f"prepared experts: {_worst_report(fig)} (state left over from the first call?)", run, r)
        if worst is None or fig.bound_ratio > worst.bound_ratio:
            worst = fig
    return worst


@check("moe", "moe_deterministic")
def check_moe_deterministic(run: MoERun, backend: Backend) -> None:
    """``run_moe`` on the same prepared experts and inputs is bitwise reproducible."""
    for r, (p, first) in enumerate(zip(run.prepared, run.outputs)):
        for i in range(DETERMINISM_REPEATS - 1):
            again = backend.run_moe(p, run.x, run.topk_ids, run.topk_weights)
            if not torch.equal(again.view(torch.int16), first.view(torch.int16)):
                diff = (again.float() - first.float()).abs()
                raise _fail("moe_deterministic", f"rank {r}, repeat {i + 2}: {int((diff > 0).sum())} elements "
                            f"differ (max {diff.max().item():.4g})", run, r)


@check("moe", "moe_input_scales_ignored", test="test_moe_input_scales_ignored")
def check_moe_input_scales_ignored(run: MoERun, backend: Backend) -> None:
    """Under W4A16 checkpoint input scales are neutral: scaling them (or removing them) leaves the output
    bitwise unchanged. Catches alphas that fold ``input_scale`` in (the W4A4 convention)."""
    for r, (experts, first) in enumerate(zip(run.ranks, run.outputs)):
        variants = {"removed": replace(experts, w13_input_scale=None, w2_input_scale=None)}
        if experts.w13_input_scale is not None:
            variants["scaled"] = replace(
                experts,
                w13_input_scale=experts.w13_input_scale * INPUT_SCALE_PERTURBATION,
                w2_input_scale=experts.w2_input_scale * INPUT_SCALE_PERTURBATION,
            )
        for name, variant in variants.items():
            y = backend.run_moe(backend.prepare_moe(variant, run.x.device), run.x, run.topk_ids, run.topk_weights)
            if not torch.equal(y.view(torch.int16), first.view(torch.int16)):
                diff = (y.float() - first.float()).abs()
                raise _fail("moe_input_scales_ignored", f"rank {r}: input scales {name} changed the output "
                            f"({int((diff > 0).sum())} elements, max {diff.max().item():.4g})", run, r)


def failing_moe_checks(backend: Backend, case: MoECase) -> dict[str, str]:
    """Every MoE check the conformance tests run, in their order, each on its own: ``{check name: first line of
    its failure}`` for those that fail (the name is the bracketed tag the failure starts with). The prepared-reuse
    check runs last, on its own run (a backend may reuse the buffer it returns)."""
    return failing_moe_checks_of_run(run_moe_case(backend, case), backend)


def failing_moe_checks_of_run(run: MoERun, backend: Backend) -> dict[str, str]:
    """:func:`failing_moe_checks` on a run already made (the prepared-reuse check makes its own)."""
    return _failing("moe", run, backend, fresh_run=lambda: run_moe_case(backend, run.case, run.x.device))
