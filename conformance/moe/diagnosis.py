"""MoE W4A16 diagnosis rules (see :mod:`conformance._framework.diagnosis` for the machinery).

Per run (:data:`RULES`), on the bracketed check names of :mod:`conformance.moe.checks`, with facts computed only
when ``moe_within_bound`` fails: *readings* (the output matches the exact value of the layer computed the way a
classic bug computes it: gate and up swapped, the gate's decode scale for up, routing weights ignored or
renormalized, duplicate ids counted once, global ids taken as local on an EP rank) and *where* it is wrong (only
tokens with a ``-1`` slot, only tokens with no expert on the rank, only tokens routed to one expert, only tokens
whose hidden states lie outside FP16's range). A reading matches when every element of every failing rank is
within the derived bound of that alternative's exact value. Across cases (:data:`PATTERNS`): a check failing only
on ``-1`` ids, duplicate ids, expert-parallel ranks, untied gate/up scales, hidden states outside FP16's range.
Every rule and pattern has a mutant that shows it (``tests/moe/mutants.py`` ``diagnosed_as``, red-team backends in
``tests/moe/test_moe_redteam.py``).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch

from conformance._framework.diagnosis import (CaseOutcome, Diagnosis, Evidence, Pattern, Rule, diagnose, diagnose_cases,
                                              appending_diagnoses)
from conformance.moe.checks import MoERun, failing_moe_checks_of_run, rank_bounds
from conformance.interfaces.kernel import Backend
from conformance.interfaces.kernel import MoEExperts
from reference_impl.bounds.moe import moe_error_bound

AREA = "MoE"
BOUND = "moe_within_bound"
ALL_CHECKS = ("moe_output_contract", BOUND, "moe_summary_figures", "moe_deterministic", "moe_ep_sum",
              "moe_input_scales_ignored", "moe_prepared_reuse")
FP16_MAX, FP16_MIN_NORMAL = 65504.0, 2.0**-14


def _r(name: str, explanation: str, **kw) -> Rule:
    return Rule.of(name, AREA, explanation, **kw)


def _reading(name: str, explanation: str) -> Rule:
    return _r(name, f"the output matches the layer computed {explanation}", fails=[BOUND], facts=[f"reads:{name}"])


RULES: tuple[Rule, ...] = (
    _r("w4a4_alpha", "the output depends on the checkpoint's input scales: the W4A4 alphas (input_scale * "
       "weight_scale_2) folded in, although W4A16 never quantizes the activations", fails=["moe_input_scales_ignored"],
       # a backend that is not bitwise repeatable changes its output whatever the input scales: no evidence then
       passes=["moe_deterministic"]),
    _reading("gate_up_swapped", "with gate and up exchanged (act(up) * gate): W13 loaded as [up; gate], or an "
             "interleave that puts the halves the other way round"),
    _reading("gate_scale_for_up", "with the gate's decode scale applied to the up half too (w13_scale_2[:, 0] "
             "for both halves)"),
    _reading("routing_weights_ignored", "without the routing weights (every slot weighted 1)"),
    _reading("weights_renormalized", "with each token's top-k weights renormalized to sum to 1: the MoE layer "
             "must use them as given"),
    _reading("duplicates_counted_once", "with a token's repeated expert id counted once: every slot counts"),
    _reading("expert_offset_ignored", "with global expert ids taken as local ones on this rank (no ep_rank * "
             "E_local offset)"),
    _r("padding_slots", "only tokens with a -1 slot are wrong: a skipped slot is computed, or its (garbage) "
       "weight read, or it ends the token's list", fails=[BOUND], facts=["wrong_rows_have_padding"]),
    _r("unrouted_rows", "only tokens with no expert on this rank are wrong: their output rows are not zeroed "
       "(they keep the input, or a previous call's values)", fails=[BOUND], facts=["wrong_rows_unrouted"]),
    _r("one_expert_wrong", "only tokens routed to local expert {expert_wrong} are wrong: that expert is skipped "
       "or misread (an off-by-one in the expert loop when it is the last one)", fails=[BOUND], facts=["expert_wrong"]),
    _r("fp16_hidden", "only tokens whose hidden states lie outside FP16's normal range are wrong: the BF16 "
       "activations went through FP16", fails=[BOUND], facts=["wrong_rows_outside_fp16"]),
    _r("nondeterministic_combine", "run-to-run differences within the bound: the combine (or a reduction) "
       "changes order or tactic between calls, e.g. atomics or a per-call autotuner choice",
       fails=["moe_deterministic"], passes=[BOUND]),
    _r("state_between_calls", "right on a fresh layer, wrong on the second batch: state carried between calls "
       "(a persistent workspace whose rows are not rewritten)", fails=["moe_prepared_reuse"], passes=[BOUND]),
)

PATTERNS: tuple[Pattern, ...] = tuple(
    Pattern(name, AREA, f"{{check}} fails only on {what} ({{failing}} cases; {{passing}} pass)", feature=feature)
    for name, feature, what in (
        ("padding_ids_only", "padding_ids", "routings with -1 slots: skipped slots are not skipped"),
        ("duplicate_ids_only", "duplicate_ids", "routings that repeat an expert in a token's top-k"),
        ("expert_parallel_only", "expert_parallel", "expert-parallel ranks: the local expert offset / ownership"),
        ("untied_gate_up_only", "untied_gate_up", "layers whose gate and up decode scales differ: one scale for "
         "both halves"),
        ("fp16_range_only", "x_outside_fp16", "hidden states outside FP16's range: BF16 converted to FP16"),
    )
)


def case_features(case) -> frozenset[str]:
    f = set(case.features)
    f |= {"expert_parallel"} if case.ep_size > 1 else set()
    f |= {"untied_gate_up"} if case.gate_up != "tied" else set()
    f |= {"x_outside_fp16"} if case.x_kind != "gaussian" else set()
    # every slot of a token on one expert: duplicate ids too
    f |= {"duplicate_ids"} if case.routing == "all_slots_one_expert" and case.top_k > 1 else set()
    return frozenset(f)


def case_shape(case) -> dict[str, int]:
    return {"tokens": case.tokens, "experts": case.experts, "top_k": case.top_k, "hidden": case.hidden,
            "intermediate": case.intermediate}


# ------------------------------------------------------------------------------------------ facts
def _within(y: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    yd = y.double()
    return torch.where(torch.isfinite(exact), (yd - exact).abs() <= bound, ~torch.isfinite(yd))


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    half = t.shape[1] // 2
    return torch.cat([t[:, half:], t[:, :half]], dim=1)


def _readings(ex: MoEExperts, ids: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], tuple]]:
    """name -> (experts, ids, weights) the reading computes with; only readings that differ here."""
    out: dict[str, Callable[[], tuple]] = {}
    valid = ids >= 0
    gated = ex.activation != "relu2"
    if gated:
        out["gate_up_swapped"] = lambda: (replace(ex, w13=_swap_halves(ex.w13), w13_scale=_swap_halves(ex.w13_scale),
                                                  w13_scale_2=ex.w13_scale_2.flip(1)), ids, w)
        if bool((ex.w13_scale_2[:, 0] != ex.w13_scale_2[:, 1]).any()):
            gate = ex.w13_scale_2[:, :1]
            out["gate_scale_for_up"] = lambda: (replace(ex, w13_scale_2=torch.cat([gate, gate], 1)), ids, w)
    out["routing_weights_ignored"] = lambda: (ex, ids, torch.where(valid, torch.ones_like(w), w))
    total = torch.where(valid, w, torch.zeros_like(w)).sum(dim=1, keepdim=True)
    out["weights_renormalized"] = lambda: (ex, ids, torch.where(valid, w / total, w))
    dup = torch.zeros_like(valid)
    for k in range(1, ids.shape[1]):
        dup[:, k] = (ids[:, k:k + 1] == ids[:, :k]).any(dim=1) & valid[:, k]
    if bool(dup.any()):
        out["duplicates_counted_once"] = lambda: (ex, torch.where(dup, torch.full_like(ids, -1), ids), w)
    if ex.ep_rank > 0:
        out["expert_offset_ignored"] = lambda: (replace(ex, ep_rank=0), ids, w)
    return out


def run_facts(run, failing: Iterable[str]) -> dict[str, Any]:
    """Facts about a failing run (module docstring); empty unless the bound failed on some rank."""
    if BOUND not in set(failing):
        return {}
    t, h = run.x.shape
    shaped = [isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and tuple(y.shape) == (t, h)
              for y in run.outputs]
    if not all(shaped):
        return {}
    refs = rank_bounds(run)
    bad_by_rank = [~_within(y, ref.exact, ref.bound) for y, ref in zip(run.outputs, refs)]
    failing_ranks = [r for r, bad in enumerate(bad_by_rank) if bool(bad.any())]
    if not failing_ranks:
        return {}
    facts: dict[str, Any] = {}
    names = _readings(run.ranks[failing_ranks[0]], run.topk_ids, run.topk_weights).keys()
    for name in names:
        facts[f"reads:{name}"] = all(_reading_matches(run, r, name) for r in failing_ranks)
    ids = run.topk_ids.long()
    bad_rows = torch.stack([bad.any(1) for bad in bad_by_rank]).any(0)
    facts["wrong_rows_have_padding"] = _only(bad_rows, (ids < 0).any(1))
    xa = run.x.double().abs()
    facts["wrong_rows_outside_fp16"] = _only(bad_rows, ((xa > FP16_MAX) | ((xa > 0) & (xa < FP16_MIN_NORMAL))).any(1))
    unrouted, expert_wrong = torch.zeros_like(bad_rows), []
    for r in failing_ranks:
        ex = run.ranks[r]
        local = ids - ex.ep_rank * ex.num_local_experts
        owned = (local >= 0) & (local < ex.num_local_experts)
        unrouted |= bad_by_rank[r].any(1) & ~owned.any(1)
        rows = bad_by_rank[r].any(1)
        hits = [e for e in range(ex.num_local_experts) if bool(((local == e) & owned).any(1)[rows].all())]
        touching = [e for e in hits if bool(torch.equal(((local == e) & owned).any(1), rows))]
        expert_wrong += [f"{e} of rank {r}" + (" (its last)" if e == ex.num_local_experts - 1 else "") for e in touching]
    facts["wrong_rows_unrouted"] = bool(bad_rows.any()) and torch.equal(unrouted, bad_rows)
    facts["expert_wrong"] = expert_wrong[0] if len(expert_wrong) == 1 else None
    return facts


def _only(bad_rows: torch.Tensor, rows: torch.Tensor) -> bool:
    return bool(bad_rows.any()) and not bool((bad_rows & ~rows).any())


def _reading_matches(run, rank: int, name: str) -> bool:
    readings = _readings(run.ranks[rank], run.topk_ids, run.topk_weights)
    if name not in readings:
        return False
    ex, ids, w = readings[name]()
    ref = moe_error_bound(run.x, ids, w, ex)
    return bool(_within(run.outputs[rank], ref.exact, ref.bound).all())


def evidence(run, failing: Iterable[str]) -> Evidence:
    failing = frozenset(failing)
    evaluated = set(ALL_CHECKS) - ({"moe_ep_sum"} if run.case.ep_size == 1 else set())
    return Evidence(AREA, failing, frozenset(evaluated) - failing, case_features(run.case), case_shape(run.case),
                    run_facts(run, failing))


def diagnose_run(run, failing: Iterable[str]) -> list[Diagnosis]:
    return diagnose(RULES, evidence(run, failing))


def diagnose_moe_cases(results: Iterable[tuple[Any, Iterable[str]]]) -> list[Diagnosis]:
    outcomes = [CaseOutcome(c.id, frozenset(f), case_features(c), case_shape(c)) for c, f in results]
    return diagnose_cases(PATTERNS, outcomes, AREA)


def diagnosed(run: MoERun | Callable[[], MoERun], backend: Backend,
              record: Callable[[str, str], None] | None = None):
    """As :func:`conformance.dense.diagnosis.diagnosed`, with every MoE check and this module's rules. ``run`` may
    be a callable making a fresh run (for checks that call the backend again on the run's prepared experts)."""
    def evaluate():
        judged = run() if callable(run) else run
        return diagnose_run(judged, failing_moe_checks_of_run(judged, backend))

    return appending_diagnoses(evaluate, record)
