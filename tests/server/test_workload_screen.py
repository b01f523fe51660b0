"""The truth's screen (reference_impl/truth/probes.py; conformance/server/workload_judge.py): a few probes first,
the rest only where a check is not clearly within bounds. Its derivation (the F tail, the threshold), and the
workload judge's verdicts with and without it on answers built around the reference: a correct answer decided on
the screen, a deviation inside the full bound that draws the rest and passes, deviations outside it failed at the
same rows as without the screen; two broken screens (one failing what it cannot decide, one deciding on its few
probes at the full bound) caught."""
from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from conformance.interfaces.server_types import TokenGeneration
from conformance.server.bounds import GOLDEN_LAMBDA
from conformance.server.workload_coverage import Coverage, Planned
from conformance.server.workload_judge import WorkloadJudge
from reference_impl.truth.golden import ExactModel
from reference_impl.truth.probes import (f_tail, joined_estimates, probe_lambda, screen_disagreement,
                                         screen_lambda)

CHECKPOINT = Path(__file__).resolve().parents[2] / "fixtures" / "checkpoints" / "dense-nvfp4_awq-a"
PROBES, SCREEN = 32, 8  # the quick workload's


def _beta_tail_numeric(x: float, a: float, b: float, steps: int = 200_000) -> float:
    """P(Beta(a, b) > x) by the midpoint rule on its density (an oracle independent of f_tail's series)."""
    log_norm = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    h = (1 - x) / steps
    total = sum(math.exp(log_norm + (a - 1) * math.log(u) + (b - 1) * math.log1p(-u))
                for u in (x + (i + 0.5) * h for i in range(steps)))
    return total * h


@pytest.mark.parametrize("c,d1,d2", [(3.0, 8, 24), (1.5, 2, 5), (0.7, 4, 60), (2.0, 16, 48)])
def test_f_tail_is_the_beta_integral(c, d1, d2):
    x = d1 * c / (d1 * c + d2)
    assert f_tail(c, d1, d2) == pytest.approx(_beta_tail_numeric(x, d1 / 2, d2 / 2), rel=1e-6)


def test_screen_lambda_meets_its_disagreement_and_no_more():
    lam = probe_lambda(PROBES, GOLDEN_LAMBDA)
    ls = screen_lambda(SCREEN, PROBES, GOLDEN_LAMBDA)
    assert lam * math.sqrt(SCREEN / PROBES) < ls < lam
    assert screen_disagreement(SCREEN, PROBES, ls, lam) <= 1e-9 < screen_disagreement(SCREEN, PROBES, ls * 1.01, lam)
    with pytest.raises(ValueError, match="even"):
        screen_lambda(7, PROBES, GOLDEN_LAMBDA)


def test_screen_disagreement_bounds_a_simulation():
    """Chi-square draws of the two stages at a loose target (0.02, to be seen in 20000 trials): the screen passes
    a check the full probes fail no more often than the bound, at the worst deviation for it."""
    k1, k, target = 4, 16, 0.02
    lam = probe_lambda(k, GOLDEN_LAMBDA)
    ls = screen_lambda(k1, k, GOLDEN_LAMBDA, disagreement=target)
    g = torch.Generator().manual_seed(0)
    n = 20000
    v1 = torch.randn(n, k1, generator=g, dtype=torch.float64).pow(2).mean(1)
    v2 = torch.randn(n, k - k1, generator=g, dtype=torch.float64).pow(2).mean(1)
    vk = (k1 * v1 + (k - k1) * v2) / k
    worst = 0.0
    for d in torch.linspace(0.5, 12.0, 47).tolist():
        differ = ((d <= ls * v1.sqrt()) & (d > lam * vk.sqrt())).double().mean().item()
        worst = max(worst, differ)
    assert 0.0 < worst <= target + 3 * math.sqrt(target / n)


@pytest.fixture(scope="module")
def model():
    return ExactModel(str(CHECKPOINT), "cpu")


def _answer(model: ExactModel, shift: dict[int, float]) -> TokenGeneration:
    """A prompt and the reference's greedy tokens with the reference's own logprobs, rows in ``shift`` moved by the
    given amounts."""
    rng = random.Random(5)
    prompt = [rng.randrange(model.cfg.vocab_size) for _ in range(12)]
    seq = list(prompt)
    for _ in range(5):
        tf = model.teacher_forced(seq, [seq[0]], 2)
        seq.append(int(tf.best[len(seq) - 1]))
    tf = model.teacher_forced(prompt, seq[len(prompt):], PROBES)
    lps = [float(tf.logprob[k]) + shift.get(k, 0.0) for k in range(len(seq) - 1)]
    return TokenGeneration(tuple(prompt), tuple(lps[:len(prompt) - 1]), tuple(seq[len(prompt):]),
                           tuple(lps[len(prompt) - 1:]))


def _full(model: ExactModel, answer: TokenGeneration):
    """The truth on all the probes the screened judge would draw (its screen's and the rest, joined)."""
    p, c = list(answer.prompt_ids), list(answer.ids)
    return joined_estimates(model.teacher_forced(p, c, SCREEN), model.teacher_forced(p, c, PROBES - SCREEN, seed=1))


def _verdict(model, answer, judge_class=WorkloadJudge, screen: int = SCREEN):
    coverage = Coverage("unit")
    judge = judge_class({"a": model}, coverage, 1, PROBES, "fp64", screen)
    plan = Planned("the answer", "a", len(answer.prompt_ids), 1)
    judge.prefetch([answer], [plan])
    judge.judge(answer, plan)
    return coverage, sorted((r.row, r.check) for r in coverage.failures)


class FailsWhatItCannotDecide(WorkloadJudge):
    """Broken: a check outside the screen's threshold is failed instead of drawing the rest."""

    def _truth(self, model, answer):
        tf = model.teacher_forced(list(answer.prompt_ids), list(answer.ids), self.screen, self.tp)
        self.lam = self.lam_screen
        return tf


class DecidesOnTheFewProbes(WorkloadJudge):
    """Broken: the full bound on the screen's probes alone (no rest drawn)."""

    def _truth(self, model, answer):
        return model.teacher_forced(list(answer.prompt_ids), list(answer.ids), self.screen, self.tp)


def test_a_correct_answer_is_decided_on_the_screen(model):
    coverage, failed = _verdict(model, _answer(model, {}))
    assert failed == [] and coverage.screen["decided"] == 1 and coverage.screen["drew_the_rest"] == 0
    assert "decided on it" in coverage.markdown()


def test_a_deviation_inside_the_full_bound_draws_the_rest_and_passes(model):
    base = _answer(model, {})
    full = _full(model, base)
    row = 7
    lam = probe_lambda(PROBES, GOLDEN_LAMBDA)
    answer = _answer(model, {row: 0.8 * lam * math.sqrt(float(full.logprob_var[row]))})
    coverage, failed = _verdict(model, answer)
    assert failed == [] and coverage.screen["drew_the_rest"] == 1
    # the broken screen fails it
    _, broken = _verdict(model, answer, FailsWhatItCannotDecide)
    assert broken == [(row, "logprob")]


def test_deviations_outside_the_full_bound_fail_where_they_fail_without_the_screen(model):
    base = _answer(model, {})
    full = _full(model, base)
    lam = probe_lambda(PROBES, GOLDEN_LAMBDA)
    shift = {k: 1.3 * lam * math.sqrt(float(full.logprob_var[k])) for k in (3, 12, 15)}
    answer = _answer(model, shift)
    screened, failed = _verdict(model, answer)
    assert failed == [(3, "logprob"), (12, "logprob"), (15, "logprob")] and screened.screen["drew_the_rest"] == 1
    unscreened_model = ExactModel(str(CHECKPOINT), "cpu")  # the full probes drawn at once, seed 0
    _, without = _verdict(unscreened_model, answer, screen=0)
    assert without == failed


def test_deciding_on_the_few_probes_at_the_full_bound_is_caught(model):
    """A row whose screen estimate is above its full one: between the two bounds the full probes fail it, the
    few-probe judge passes it, the screen draws the rest and fails it."""
    base = _answer(model, {})
    p, c = list(base.prompt_ids), list(base.ids)
    few, full = model.teacher_forced(p, c, SCREEN), _full(model, base)
    ratio = few.logprob_var / full.logprob_var
    row = int(ratio.argmax())
    assert float(ratio[row]) > 1.1  # 8 of 32 probes: some row's screen estimate is well above the full one
    lam = probe_lambda(PROBES, GOLDEN_LAMBDA)
    shift = lam * math.sqrt(float(full.logprob_var[row])) * math.sqrt(float(ratio[row])) ** 0.5  # between
    answer = _answer(model, {row: shift})
    _, failed = _verdict(model, answer)
    assert failed == [(row, "logprob")]
    _, broken = _verdict(model, answer, DecidesOnTheFewProbes)
    assert broken == []
