"""Golden truth for the server scenarios: the reference model's greedy outputs for :data:`PROMPTS`, and the
comparison of a server's generations with them.

Where the golden outputs come from (see :mod:`reference_impl.truth.golden` for what they hold):

* fixture checkpoints: files ``fixtures/snapshots/_server_golden/<family>-<set>.tensors.json`` (the snapshot format of
  conformance/_framework/snapshots.py), written by ``pytest tests/server/test_server_golden.py --snapshot-update`` and
  re-checked against the reference by that test module; each records the digest of the checkpoint it was
  made from, so a changed fixture is an error, not a silent mismatch;
* a user's checkpoint (``--server-checkpoint``): computed by the reference model at session start.

The comparison (:func:`compare_with_golden`), per prompt and step: the token ids must be identical up to
the first step where the engine picks another token; that step is a legitimate divergence only if the
reference's logit gap between its token and the engine's is inside the derived bound
(:func:`conformance.server.bounds.golden_bound`), and the comparison of that prompt stops there. Every
compared logprob must be within its own bound.

MoE routing: a decision whose router-logit gap (k-th vs (k+1)-th expert) is inside its bound is a near tie a
correct engine may take the other way; that moves everything after it by a discrete amount, and can tip
later decisions too. Where a step disagrees with the golden path after such a near tie, the reference
searches the *branches*: the path recomputed with near ties flipped (one forward each; decisions that
become near ties in a branch are flipped in turn, breadth first, up to :data:`MAX_BRANCHES` forwards). The
disagreement is legitimate if some branch has the engine's token within the gap bound of its best token
and the engine's logprob within the logprob bound; the comparison of that prompt stops there.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from conformance._framework.snapshots import Approx, deserialize_entries, missing_golden_message, snapshot_root
from conformance.server.bounds import golden_bound
from conformance.interfaces.server_types import Generation
from conformance.server.fidelity import check_logprob_fidelity

PROMPTS = ("the city of water", "a new river and the old stone tree", "music of the sea and the moon",
           "people of the north")
MAX_NEW_TOKENS = 8
GREEDY = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
#: the fixtures' golden files, in the snapshot root under a name no test module has: syrupy scans the folders
#: named after test modules and counted these as unused snapshots of the skipped writer, advising to delete them
GOLDEN_DIR = "_server_golden"
# Golden values are fp64 with fp32 transcendentals (rotary angles, softmaxes) that may differ by an fp32 ulp
# (2^-23 relative) between CPU math libraries; through these models' sensitivities (|d logprob / d v| * |v|
# summed over a store is < 50 on the fixtures) that moves a logprob or a gap by < 1e-5. Variance proxies are
# sums of squares of the same quantities: relative 1e-5.
VALUE_ATOL = 1e-5
VARIANCE_RTOL = 1e-5
MAX_BRANCHES = 48  # forwards of the reference spent explaining one disagreement after near-tie routings


def snapshot_path(family: str, weight_set: str) -> Path:
    return snapshot_root() / GOLDEN_DIR / f"{family}-{weight_set}.tensors.json"


# ----------------------------------------------------------------------------------------- (de)serialization
def golden_entries(g, prompts: tuple[str, ...] = PROMPTS) -> dict:
    """Snapshot entries of a :class:`reference_impl.truth.golden.GoldenSet` (ids exact, floats within the
    tolerances above)."""
    why_v = f"fp32 transcendentals may differ by an ulp across CPU libraries: |d| < {VALUE_ATOL} (conformance/server/golden.py)"
    why_var = f"sums of squares of the same quantities: relative {VARIANCE_RTOL} (conformance/server/golden.py)"
    entries: dict = {"checkpoint_digest": g.checkpoint_digest}
    for i, (text, ids) in enumerate(zip(prompts, g.prompt_ids)):
        entries[f"prompt_{i}"] = text
        entries[f"prompt_ids_{i}"] = torch.tensor(ids, dtype=torch.int64)
    entries.update({
        "output_ids": g.output_ids, "top_ids": g.top_ids,
        "logprobs": Approx(g.logprobs, 0.0, VALUE_ATOL, why_v),
        "top_gaps": Approx(g.top_gaps, 0.0, VALUE_ATOL, why_v),
        "route_gaps": Approx(g.route_gaps, 0.0, VALUE_ATOL, why_v),
        "logprob_var": Approx(g.logprob_var, VARIANCE_RTOL, 0.0, why_var),
        "route_var": Approx(g.route_var, VARIANCE_RTOL, 0.0, why_var),
    })
    return entries


def golden_from_entries(entries: dict):
    from reference_impl.truth.golden import GoldenSet

    n = len([k for k in entries if k.startswith("prompt_ids_")])
    return GoldenSet(entries["checkpoint_digest"], [entries[f"prompt_ids_{i}"].tolist() for i in range(n)],
                     entries["output_ids"], entries["logprobs"], entries["logprob_var"], entries["top_ids"],
                     entries["top_gaps"], entries["route_gaps"], entries["route_var"])


def compute_golden(path: str, prompt_ids: list[list[int]], variances: bool = True, device: str | None = None,
                   candidates: list[list[int]] | None = None):
    """The golden outputs of checkpoint ``path`` by the reference model (what the snapshots hold)."""
    from reference_impl.truth.golden import ExactModel

    return ExactModel(path, device).golden(prompt_ids, MAX_NEW_TOKENS, variances=variances, candidates=candidates)


def load_fixture_golden(family: str, weight_set: str):
    path = snapshot_path(family, weight_set)
    if not path.is_file():
        raise FileNotFoundError(f"fixture {family}-{weight_set}: {missing_golden_message(path)}")
    return golden_from_entries(deserialize_entries(path.read_text()))


# ----------------------------------------------------------------------------------------- truth of one weight set
@dataclass
class GoldenTruth:
    """The golden outputs of one checkpoint directory, and (loaded on demand) the reference model that can
    answer for a token the stored top-K does not hold."""

    label: str
    path: str
    golden: object  # reference_impl.truth.golden.GoldenSet
    _exact: object = field(default=None, repr=False)
    device: str | None = None  # where the reference model runs (--truth-device; None: CUDA if available)
    _forced: dict = field(default_factory=dict, repr=False)  # (prompt, continuation, temperature) -> ForcedPath

    def exact(self):
        if self._exact is None:
            from reference_impl.truth.golden import ExactModel

            self._exact = ExactModel(self.path, self.device)
            if self._exact.digest != self.golden.checkpoint_digest:
                raise AssertionError(f"{self.path}: the checkpoint changed since its golden outputs were made")
        return self._exact

    def gap(self, prompt: int, step: int, token: int) -> tuple[float, torch.Tensor]:
        """(logit gap, variance proxies) between the reference's token at ``step`` and ``token``, computed by
        the reference model (only needed where an engine diverges)."""
        g = self.golden
        return self.exact().gap_variance(g.prompt_ids[prompt], g.output_ids[prompt].tolist(), step, token)

    def explain(self, prompt: int, step: int, token: int, logprob: float, tp: int) -> str | None:
        """A branch of near-tie routing flips in which ``token`` with ``logprob`` at ``step`` is within
        bounds (described), or None. Breadth first over flip sets, at most MAX_BRANCHES forwards."""
        g = self.golden
        gap_var = self.gap(prompt, step, token)[1] if token != int(g.output_ids[prompt, step]) else None
        gap_bound = float(golden_bound(gap_var, tp)) if gap_var is not None else 0.0
        lp_bound = float(golden_bound(g.logprob_var[prompt, step], tp))

        def accept(row: torch.Tensor) -> str | None:
            lp = float(torch.log_softmax(row, -1)[token])
            if float(row.max() - row[token]) <= gap_bound and abs(logprob - lp) <= lp_bound + gap_bound:
                return f"gives token {token} with logprob {lp:.4f}"
            return None

        return self.search_branches(g.prompt_ids[prompt], g.output_ids[prompt].tolist(), step, accept,
                                    lambda t, s: float(golden_bound(g.route_var[prompt, t, s], tp)))

    def search_branches(self, ids: list[int], cont: list[int], step: int, accept, route_bound) -> str | None:
        """Breadth first over sets of near-tie routing flips on the path ``ids + cont`` (a decision of slot s at
        position t is a near tie when its gap is within ``route_bound(t, s)``), at most MAX_BRANCHES forwards:
        the first branch whose step logits ``accept`` (a description, or None)."""
        from reference_impl.truth.instrument import slot

        ex, last = self.exact(), len(ids) - 1 + step
        queue, seen, spent = [{}], {()}, 0
        while queue and spent < MAX_BRANCHES:
            forced = queue.pop(0)
            logits, routes = ex.branch(ids, cont, forced)
            spent += 1
            why = accept(logits[step])
            if why:
                return f"routing {sorted(forced)} taken the other way (a branch of near ties) {why}"
            for decision in routes:
                s = slot(ex.cfg, decision.layer, decision.kind)
                gaps = decision.gaps.tolist()
                for t in range(min(last + 1, len(gaps))):
                    if (s, t) in forced or not math.isfinite(gaps[t]) or gaps[t] > route_bound(t, s):
                        continue
                    nxt = {**forced, (s, t): decision.flips[t]}
                    key = tuple(sorted(nxt))
                    if key not in seen:
                        seen.add(key)
                        queue.append(nxt)
        return None


@dataclass
class GoldenResult:
    compared: int = 0           # tokens compared
    worst_ratio: float = 0.0    # max |logprob - golden| / bound over compared tokens
    notes: list[str] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)  # what the scenario saw and reports, not judged

    def add(self, other: "GoldenResult") -> None:
        self.compared += other.compared
        self.worst_ratio = max(self.worst_ratio, other.worst_ratio)
        self.notes += other.notes
        self.observations += other.observations


def near_ties(g, prompt: int, tp: int) -> list[tuple[int, int]]:
    """Routing decisions (position, slot) of ``prompt`` whose router-logit gap is inside its bound."""
    gaps = g.route_gaps[prompt]
    near = torch.isfinite(gaps) & (gaps <= golden_bound(g.route_var[prompt], tp))
    return [(int(t), int(layer)) for t, layer in near.nonzero()]


def compare_with_golden(outputs: list[Generation], truth: GoldenTruth, tp: int, what: str,
                        prompts: tuple[str, ...] = PROMPTS) -> GoldenResult:
    """Raise AssertionError (message starting with ``what``) where ``outputs`` are not the reference's
    golden outputs of ``truth`` within the derived bounds; return what was compared."""
    g, result = truth.golden, GoldenResult()
    assert len(outputs) == len(g.prompt_ids), f"{what}: {len(outputs)} outputs for {len(g.prompt_ids)} prompts"
    check_logprob_fidelity([x for out in outputs for x in (out.logprobs or ())], what)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        where = f"{what}: prompt {prompt!r}"
        if out.prompt_tokens is not None and out.prompt_tokens != len(g.prompt_ids[i]):
            raise AssertionError(f"{where}: the server counted {out.prompt_tokens} prompt tokens, the reference's "
                                 f"tokenizer gives {len(g.prompt_ids[i])} ({g.prompt_ids[i]}): is it serving with "
                                 f"the same tokenizer (--tokenizer)?")
        assert out.logprobs is not None, f"{where}: no logprobs returned"
        assert len(out.ids) >= g.max_new_tokens, (
            f"{where}: {len(out.ids)} tokens, expected {g.max_new_tokens} (finish_reason {out.finish_reason})")
        ties = near_ties(g, i, tp)
        for j in range(g.max_new_tokens):
            token, ref = out.ids[j], int(g.output_ids[i, j])
            lp, ref_lp = out.logprobs[j], float(g.logprobs[i, j])
            bound = float(golden_bound(g.logprob_var[i, j], tp))
            gap = gap_bound = 0.0
            if token != ref:
                gap, gap_var = truth.gap(i, j, token)
                gap_bound = float(golden_bound(gap_var, tp))
            diff = abs(lp - (ref_lp - gap))
            if not (gap <= gap_bound and diff <= bound + gap_bound):  # also catches NaN
                if any(t <= len(g.prompt_ids[i]) - 1 + j for t, _ in ties):
                    why = truth.explain(i, j, token, lp, tp)
                    if why:
                        result.notes.append(f"prompt {i}, step {j}: {why}; comparison stopped")
                        break
                if token != ref:
                    raise AssertionError(
                        f"{where}, step {j}: token id {token} where the reference's golden output {truth.label} has "
                        f"{ref} (golden ids {g.output_ids[i].tolist()}, got {list(out.ids[:g.max_new_tokens])}); "
                        f"their reference logit gap {gap:.4g} exceeds its bound {gap_bound:.4g}: not a legitimate "
                        f"divergence{' (nor explained by near-tie routings)' if ties else ''}")
                raise AssertionError(
                    f"{where}, step {j} (id {token}): logprob {lp:.6f} vs the reference's golden {ref_lp:.6f} "
                    f"({truth.label}): |diff| {diff:.3e} > bound {bound:.3e} (conformance/server/bounds.golden_bound)"
                    f"{' (nor explained by near-tie routings)' if ties else ''}")
            result.compared += 1
            result.worst_ratio = max(result.worst_ratio, diff / (bound + gap_bound) if bound > 0 else math.inf)
            if token != ref:
                result.notes.append(f"prompt {i}: legitimate divergence at step {j} (gap {gap:.3g} <= {gap_bound:.3g})")
                break
    return result


def compare_sampled_with_reference(outputs: list[Generation], truth: GoldenTruth, tp: int, temperature: float,
                                   what: str, prompts: tuple[str, ...] = PROMPTS) -> GoldenResult:
    """Sampled generations: each returned logprob must be the reference's logprob of the token the engine
    sampled, given the engine's own prefix (teacher-forced through the exact model), within its bound. Both
    conventions engines use are accepted: the raw distribution (vLLM's default, SGLang with
    SGLANG_RETURN_ORIGINAL_LOGPROB, the reference server) and the temperature-scaled one (SGLang 0.5.23's
    default, ``log_softmax(logits / temperature)``; its bound comes from the variance proxies of that very
    function). The tokens themselves are not judged (engines' random streams differ). On a MoE model a
    disagreement after a near-tie routing on that path is searched for in the branches, as for greedy
    outputs, and the comparison of that prompt stops there if a branch explains it."""
    g, result = truth.golden, GoldenResult()
    assert len(outputs) == len(g.prompt_ids), f"{what}: {len(outputs)} outputs for {len(g.prompt_ids)} prompts"
    check_logprob_fidelity([x for out in outputs for x in (out.logprobs or ())], what)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        where = f"{what}: prompt {prompt!r}"
        assert out.logprobs is not None and len(out.logprobs) >= len(out.ids), f"{where}: no logprobs returned"
        cont, ids = [int(t) for t in out.ids], g.prompt_ids[i]
        key = (i, tuple(cont), temperature)
        if key not in truth._forced:
            truth._forced[key] = truth.exact().forced(ids, cont, temperature)
        path = truth._forced[key]
        route_var = {(t, s): var for t, s, _gap, var in path.routes}
        ties = [t for t, _slot, gap, var in path.routes if gap <= float(golden_bound(var, tp))]
        for j in range(len(cont)):
            lp = out.logprobs[j]
            raw_b = float(golden_bound(path.raw_var[j], tp))
            scaled_b = float(golden_bound(path.scaled_var[j], tp))

            def ratio_of(raw: float, scaled: float) -> float:
                return min(abs(lp - raw) / raw_b if raw_b > 0 else math.inf,
                           abs(lp - scaled) / scaled_b if scaled_b > 0 else math.inf)

            ratio = ratio_of(float(path.raw[j]), float(path.scaled[j]))
            if not ratio <= 1.0:  # also catches NaN
                if any(t <= len(ids) - 1 + j for t in ties):
                    def accept(row, tok=cont[j]):
                        r = ratio_of(float(torch.log_softmax(row, -1)[tok]),
                                     float(torch.log_softmax(row / temperature, -1)[tok]))
                        return f"gives the sampled token logprob {lp:.4f} (ratio {r:.2f})" if r <= 1.0 else None

                    why = truth.search_branches(ids, cont, j, accept,
                                                lambda t, s: float(golden_bound(route_var[(t, s)], tp)))
                    if why:
                        result.notes.append(f"prompt {i}, sampled step {j}: {why}; comparison stopped")
                        break
                raise AssertionError(
                    f"{where}, sampled step {j} (id {cont[j]}, sampled path {cont}): logprob {lp:.6f} is not the "
                    f"reference's logprob of that token: raw {float(path.raw[j]):.6f} (bound {raw_b:.3e}) nor "
                    f"temperature-scaled (T={temperature}) {float(path.scaled[j]):.6f} (bound {scaled_b:.3e}) "
                    f"({truth.label}; conformance/server/bounds.golden_bound)"
                    f"{' (nor explained by near-tie routings)' if ties else ''}")
            result.compared += 1
            result.worst_ratio = max(result.worst_ratio, ratio)
    return result


def label_of(path: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(path).name) or "checkpoint"
