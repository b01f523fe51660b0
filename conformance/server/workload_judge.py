"""The workload scenarios' judge: every prompt position and every generated token of an engine's answer, checked
against the reference by teacher forcing over the engine's own tokens, and the coverage it adds up to.

For one answer (prompt ``P``, the engine's continuation ``C``, the prompt logprobs and the generated tokens'
logprobs it returned) the truth is one teacher-forced pass over ``P + C``
(:meth:`reference_impl.truth.golden.ExactModel.teacher_forced`): at every row the reference's logprob of the next token
and its best token, with variance estimates from forward-mode probes (:mod:`reference_impl.truth.probes`).

Checks, per row ``k`` (the prediction of token ``k + 1``), bound ``LAMBDA_K sqrt(V_hat)``
(:func:`reference_impl.truth.probes.probe_lambda`; false-failure risk 3.0e-8 per check, the golden bounds' risk):

* ``logprob``: ``|engine logprob - reference logprob| <= bound`` (prompt tokens: the prefill's outputs; generated
  tokens: the decode's);
* ``choice`` (generated tokens only): where the engine's token is not the reference's best, the reference's logit
  gap between the two must be within its bound (a near tie a correct BF16 engine may take either way). Each step
  is judged on the engine's own prefix, so a legitimate divergence does not end the comparison.

The screen (:func:`reference_impl.truth.probes.screen_lambda`): each answer's truth first takes a few of the probes;
an answer whose every check is within ``LAMBDA_S sqrt(V_hat)`` on them is decided there (it passes), any other
draws the rest and is judged on all of them as above. The screen never fails a check: the verdicts are the full
probes' except, with probability at most 1e-9 per check, a check they would fail that the screen passed.

MoE routing: a row that fails while some routing decision at or before it is a near tie (its gap within its bound)
is judged again on the branches with those decisions taken the other way (breadth first, at most
:data:`MAX_BRANCHES` forwards per answer): it passes if a branch puts it within bounds.

Each row is attributed to the *phase* and *token-count bucket* of the forward that computed it in the workload's
plan: prompt rows and the first generated token to the prefill (bucket of the prefill's token count), later
generated tokens to the decode (bucket of the number of sequences decoding); mixed traffic to its own 'mixed' row
(the engine's scheduler composes those forwards). The buckets are the planned sizes: an engine that splits a
prefill into chunks (8192 tokens by default in vLLM) computes it in smaller forwards. The coverage map counts, per cell,
rows judged and failed, and names the expected cells nothing reached.
"""
from __future__ import annotations

import math

import torch

from conformance.interfaces.server_types import TokenGeneration
from conformance.server.bounds import GOLDEN_LAMBDA
from conformance.server.workload_coverage import Coverage, Planned, Row

MAX_BRANCHES = 48
MAX_TIES_HERE = 6  # near ties at a failing row's own position tried in subsets (2^6 - 1 sets at most)
#: the seed of the probes drawn after a screen (the screen's are seed 0; every pass's groups are seeded apart from
#: both: reference_impl/truth/probes.py)
REST_SEED = 1


class WorkloadJudge:
    """Judges answers against one checkpoint per weight set (``exact[weight set]``: an
    :class:`reference_impl.truth.golden.ExactModel`), adding to ``coverage``."""

    def __init__(self, exact: dict, coverage: Coverage, tp: int = 1, probes: int | None = None,
                 precision: str = "fp64", screen: int = 0):
        from reference_impl.truth.probes import DEFAULT_PROBES, probe_lambda, screen_lambda

        self.exact, self.coverage, self.tp, self.precision = exact, coverage, tp, precision
        self.probes = probes or DEFAULT_PROBES
        self.lam = probe_lambda(self.probes, GOLDEN_LAMBDA)  # the golden bounds' risk
        # the screen (reference_impl/truth/probes.py): ``screen`` probes first, the rest only where a check is not
        # clearly within bounds on them; it never fails a check itself
        self.screen = screen if 0 < screen < self.probes else 0
        self.lam_screen = screen_lambda(self.screen, self.probes, GOLDEN_LAMBDA) if self.screen else 0.0
        coverage.screen = {"probes": self.screen, "of": self.probes, "lambda": round(self.lam_screen, 4),
                           "decided": 0, "drew_the_rest": 0} if self.screen else None

    def bound(self, var: float, lam: float | None = None) -> float:
        """``LAMBDA_K sqrt(V_hat)`` (``lam``: another multiplier, the screen's)."""
        return (self.lam if lam is None else lam) * math.sqrt(max(float(var), 0.0))

    def _outside(self, tf, k: int, lp: float, prompt_len: int, lam: float | None = None) -> tuple[str, float] | None:
        """Row ``k``'s failing check and its bound (``lam``: the multiplier, the full probes' by default), or None:
        ``choice`` where the engine's generated token is not the reference's best and the reference's gap exceeds
        its bound, else ``logprob`` where the engine's logprob is outside its bound."""
        if k >= prompt_len - 1 and int(tf.best[k]) != tf.tokens[k + 1]:
            gb = self.bound(tf.gap_var[k], lam)
            if float(tf.gap[k]) > gb:
                return "choice", gb
        bd = self.bound(tf.logprob_var[k], lam)
        return None if abs(lp - float(tf.logprob[k])) <= bd else ("logprob", bd)

    def prefetch(self, answers: list[TokenGeneration], plans: list[Planned]) -> None:
        """The truth of a batch of answers at once (per weight set): sequences of one length share probed passes
        (one pass per sequence would make every pass carry its own weight draws), and the rest of the probes of
        the answers the screen leaves undecided, at once too; :meth:`judge` then finds them."""
        by_set: dict[str, list] = {}
        for answer, plan in zip(answers, plans):
            if answer.ids:
                by_set.setdefault(plan.weight_set, []).append(answer)
        for weight_set, items in by_set.items():
            model = self.exact[weight_set]
            pairs = [(list(a.prompt_ids), list(a.ids)) for a in items]
            first = model.teacher_forced_many(pairs, self.screen or self.probes, self.tp, precision=self.precision)
            if self.screen:
                rest = [pair for pair, a, tf in zip(pairs, items, first) if not self._clears_screen(a, tf)]
                if rest:
                    model.teacher_forced_many(rest, self.probes - self.screen, self.tp, seed=REST_SEED,
                                              precision=self.precision)

    def _rows(self, answer: TokenGeneration, request: str) -> tuple[range, list[float]]:
        """The rows an answer's logprobs judge (from the first prompt position when it returned prompt logprobs)
        and those logprobs; an AssertionError where their count is not the rows'."""
        prompt, cont = list(answer.prompt_ids), list(answer.ids)
        lp_engine = list(answer.prompt_logprobs or ()) + list(answer.logprobs)
        first_row = 0 if answer.prompt_logprobs is not None else len(prompt) - 1
        rows = range(first_row, len(prompt) + len(cont) - 1)
        if len(lp_engine) != len(rows):
            raise AssertionError(f"{request}: {len(lp_engine)} logprobs for {len(rows)} positions")
        return rows, lp_engine

    def _clears_screen(self, answer: TokenGeneration, tf) -> bool:
        """Whether every check of ``answer`` is within the screen's threshold on ``tf`` (the screen's probes): its
        logprob deviations and, where its token is not the reference's best, the reference's gap."""
        try:
            rows, lp_engine = self._rows(answer, "")
        except AssertionError:
            return False  # judge() reports it
        prompt_len = len(answer.prompt_ids)
        return all(self._outside(tf, k, lp, prompt_len, self.lam_screen) is None for k, lp in zip(rows, lp_engine))

    def _truth(self, model, answer: TokenGeneration):
        """The answer's truth: the screen's probes where they clear it, else all the probes (joined)."""
        from reference_impl.truth.probes import joined_estimates

        prompt, cont = list(answer.prompt_ids), list(answer.ids)
        tf = model.teacher_forced(prompt, cont, self.screen or self.probes, self.tp, precision=self.precision)
        if not self.screen:
            return tf
        if self._clears_screen(answer, tf):
            self.coverage.screen["decided"] += 1
            return tf  # every check within LAMBDA_S sqrt(V_hat_1) < LAMBDA_K sqrt(V_hat_1): none can fail below
        self.coverage.screen["drew_the_rest"] += 1
        more = model.teacher_forced(prompt, cont, self.probes - self.screen, self.tp, seed=REST_SEED,
                                    precision=self.precision)
        return joined_estimates(tf, more)

    def judge(self, answer: TokenGeneration, plan: Planned) -> None:
        prompt, cont = list(answer.prompt_ids), list(answer.ids)
        if not cont:
            raise AssertionError(f"{plan.request}: the server generated no token (asked for a continuation)")
        model = self.exact[plan.weight_set]
        rows, lp_engine = self._rows(answer, plan.request)
        tf = self._truth(model, answer)
        failing: list[Row] = []
        judged = []  # per row: (row, its cell, engine logprob, reference logprob, bound, the failure or None)
        for k, lp in zip(rows, lp_engine):
            cell = plan.cell("prefill" if k < len(prompt) else "decode")
            ref, bd = float(tf.logprob[k]), self.bound(tf.logprob_var[k])
            bad, outside = None, self._outside(tf, k, lp, len(prompt))
            if outside and outside[0] == "choice":
                gb = outside[1]
                bad = Row(plan.request, *cell, k, "choice", lp, ref, gb,
                          f"token {tf.tokens[k + 1]} where the reference's best {int(tf.best[k])} leads by "
                          f"{float(tf.gap[k]):.4f} > its bound {gb:.3e}: ")
            elif outside:
                bad = Row(plan.request, *cell, k, "logprob", lp, ref, bd)
            judged.append((k, cell, lp, ref, bd, bad))
            if bad:
                failing.append(bad)
        explained = self._explain(model, tf, failing) if failing else set()
        for k, cell, lp, ref, bd, bad in judged:
            c = self.coverage.cell(*cell)
            c.judged += 1
            c.nll_delta_sum += ref - lp
            if k in explained:
                c.explained += 1
            else:  # the worst ratio of the rows judged on the reference's own routing
                c.worst_ratio = max(c.worst_ratio, abs(lp - ref) / max(bd, 1e-300))
            if k >= len(prompt) - 1:
                c.generated += 1
                c.top1_mismatch += int(int(tf.best[k]) != tf.tokens[k + 1])
            if bad is not None and k not in explained:
                c.failed += 1
                self.coverage.failures.append(bad)

    def _explain(self, model, tf, failing: list[Row]) -> set[int]:
        """Rows among ``failing`` that a branch of near-tie routing flips puts within bounds. Per failing row, the
        flip sets tried: every non-empty subset of the near ties at its own position (the decisions that move
        it most), then those with every near tie before it flipped too; at most MAX_BRANCHES forwards."""
        from reference_impl.truth.instrument import slot

        ties = sorted((t, s) for t, s, gap, var in tf.routes if gap <= self.bound(var))
        ratio = {(s, t): gap / max(self.bound(var), 1e-300) for t, s, gap, var in tf.routes}
        if not ties:
            return set()
        seq = tf.tokens
        _, routes = model.branch(seq[:1], seq[1:], {})
        flips = {}
        for d in routes:
            s = slot(model.cfg, d.layer, d.kind)
            for t in range(len(d.flips)):
                flips[(s, t)] = d.flips[t]
        todo = {r.row: r for r in failing}
        explained, spent, tried = set(), 0, set()
        for row in sorted(todo):
            # the closest ties first, at most MAX_TIES_HERE of them (an MoE with many routing slots per position)
            here = sorted(((s, t) for t, s in ties if t == row and (s, t) in flips), key=lambda k: ratio[k])
            here = here[:MAX_TIES_HERE]
            before = {(s, t): flips[(s, t)] for t, s in ties if t < row and (s, t) in flips}
            for forced in _flip_sets(here, before, flips):
                if spent >= MAX_BRANCHES or row in explained:
                    break
                key = tuple(sorted(forced))
                if key in tried:
                    continue
                tried.add(key)
                logits, _ = model.branch(seq[:1], seq[1:], forced)
                spent += 1
                lps = torch.log_softmax(logits, -1)
                first = min(t for s, t in forced)
                for r in todo.values():  # a branch may explain other rows after its first flip too
                    if r.row in explained or r.row < first:
                        continue
                    if self._within_on_branch(tf, r, logits, lps):
                        explained.add(r.row)
        if explained:
            self.coverage.notes.append(f"{len(explained)} position(s) of one answer within bounds on a branch of "
                                       f"near-tie routings ({len(ties)} near ties)")
        return explained

    def _within_on_branch(self, tf, r: Row, logits: torch.Tensor, lps: torch.Tensor) -> bool:
        """Whether row ``r`` is within bounds on a branch (its ``logits`` and their log-softmax ``lps``), as the
        golden comparison's branches (conformance/server/golden.py): a token the engine chose within its gap bound
        of the branch's best and its logprob within the logprob and gap bounds; a prompt token (nobody chose it)
        its logprob within the logprob bound."""
        seq = tf.tokens
        lp = float(lps[r.row, seq[r.row + 1]])
        lp_bound = self.bound(tf.logprob_var[r.row])
        if r.row < tf.prompt_len - 1:
            return abs(r.engine - lp) <= lp_bound
        gap = float(logits[r.row].max() - logits[r.row, seq[r.row + 1]])
        gap_bound = self.bound(tf.gap_var[r.row]) if float(tf.gap_var[r.row]) > 0 else lp_bound
        return gap <= gap_bound and abs(r.engine - lp) <= lp_bound + gap_bound


def _flip_sets(here: list, before: dict, flips: dict):
    """The flip sets tried for one failing row: every non-empty subset of the near ties at its own position
    (``here``), then the flips of every near tie before it (``before``) alone and with each of those subsets."""
    from itertools import chain, combinations

    subsets = [dict((k, flips[k]) for k in c) for n in range(1, len(here) + 1) for c in combinations(here, n)]
    if not before:
        return iter(subsets)
    return chain(subsets, [before], ({**before, **sub} for sub in subsets))
