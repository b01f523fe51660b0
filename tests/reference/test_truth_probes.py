"""The forward-mode probes (reference_impl/truth/probes.py) against the exact reverse-mode variance proxies of the
same rounding model, on the fixtures: values identical, the estimate unbiased with the chi-square spread its
bound assumes, the multiplier's risk what the docstring derives."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import reference_impl.truth.instrument as instrument
import reference_impl.truth.stores as stores
from reference_impl.truth.engine import Output, Request, TruthModel
from conformance.server.bounds import GOLDEN_LAMBDA
from reference_impl.truth.probes import probe_lambda, probe_sequences, route_outputs

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "checkpoints"
U = (2.0 ** -8, 2.0 ** -23)


def test_multiplier_has_the_exact_bounds_risk():
    for k in (8, 32, 64, 128, 1024):
        lam = probe_lambda(k, GOLDEN_LAMBDA)
        risk = 2 * (1 + lam ** 2 / k) ** (-k / 2)  # the chi-square MGF bound of the module docstring
        assert math.isclose(risk, 2 * math.exp(-GOLDEN_LAMBDA ** 2 / 2), rel_tol=1e-9)
    assert probe_lambda(64, GOLDEN_LAMBDA) == pytest.approx(6.95, abs=0.01)
    assert probe_lambda(10 ** 6, GOLDEN_LAMBDA) == pytest.approx(GOLDEN_LAMBDA, abs=1e-3)  # many probes: the exact bound
    assert probe_lambda(16, GOLDEN_LAMBDA) > probe_lambda(64, GOLDEN_LAMBDA) > GOLDEN_LAMBDA
    with pytest.raises(ValueError):
        probe_lambda(0, GOLDEN_LAMBDA)


def _exact(tm: TruthModel, ids: list[int], tp: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Exact values and variances (absolute units, the TP component included) of every row's next-token logprob."""
    res = tm.analyse([Request(ids, [Output("logprob", r, ids[r + 1]) for r in range(len(ids) - 1)], len(ids))])[0]
    v = res.variances.detach()
    var = U[0] ** 2 * v[:, 0] + U[1] ** 2 * v[:, 1]
    if tp > 1:
        var = var + U[0] ** 2 * v[:, 2 + (2, 4, 8).index(tp)]
    return res.values.detach(), var, res.routes


# A mean ratio's standard deviation is sqrt(2 / (probes * seeds)); the weight-rounding draws (probes x the weights
# per pass) dominate the cost on the fixtures, so the power is set per case: dense 64 x 12 (sd 0.051: a term of
# 20 % of the variance missing or doubled is caught), MoE 32 x 12 (sd 0.072).
ALLOWED_SD = 4.0  # a correct estimator's row mean falls outside with probability 6e-5 (the draws are seeded: fixed)


#: |probe value - exact value| allowed: fp64 sums agree to 1e-12; under probes, attention in blocks of queries takes
#: each block's keys up to its last query (reference_impl/truth/instrument.py), and the softmax, in fp32 as
#: transformers', then sums fewer keys: its probabilities move by a few units of 2^-24 (6e-8) times the <= 8 keys,
#: a logprob by less than 1e-5
VALUE_ATOL = {False: 1e-12, True: 1e-5}


def _mean_ratios(family: str, tp: int, probes: int, seeds: int, blocked: bool = False):
    """Per row, the mean over SEEDS draws of V_hat / V (two sequences in one pass); routing gaps pooled.
    ``blocked``: attention in blocks of 3 queries in the probed passes."""
    tm = TruthModel(str(FIXTURES / f"{family}-a"), "cpu")
    g = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, tm.cfg.vocab_size, (8,), generator=g).tolist() for _ in range(2)]
    exact = [_exact(tm, s, tp) for s in seqs]
    ratios, route_ratios = [[] for _ in seqs], []
    if blocked:  # after the exact analysis: blocks of 3 queries of 8 in the probed passes
        instrument.ATTENTION_BLOCK_ELEMENTS = probes * len(seqs) * tm.cfg.num_heads * 8 * 3
    for seed in range(seeds):
        probed = probe_sequences(tm, [s[:-1] for s in seqs], [s[1:] for s in seqs], probes, tp, seed)
        for i, (p, s) in enumerate(zip(probed, seqs)):
            values, v_hat = p.logprob, p.logprob_var
            assert torch.allclose(values, exact[i][0][:len(s) - 1], rtol=0, atol=VALUE_ATOL[blocked])
            ratios[i].append(v_hat / exact[i][1][:len(s) - 1])
            if exact[i][2]:
                ex = {key: float(var) for key, var in zip(exact[i][2], exact[i][1][len(s) - 1:])}
                route_ratios.append(torch.tensor([v / ex[(t, sl)] for t, sl, gap, v in route_outputs(tm.cfg, p)
                                                  if (t, sl) in ex]))
    rows = torch.cat([torch.stack(r).mean(0) for r in ratios])
    routes = torch.stack(route_ratios).mean(0) if route_ratios else None
    return rows, routes


@pytest.mark.parametrize("family,tp,probes,seeds,blocked", [("dense-nvfp4_awq", 1, 64, 12, False),
                                                             ("moe-nvfp4", 2, 32, 12, False),
                                                             ("dense-nvfp4_awq", 1, 64, 12, True)])
def test_probes_are_an_unbiased_chi_square_estimate(family, tp, probes, seeds, blocked, monkeypatch):
    """K V_hat / V ~ chi^2_K: over SEEDS independent draws a mean ratio has standard deviation
    sqrt(2 / (K SEEDS)); every row's mean (and every routing gap's) must be within ALLOWED_SD of them of 1.
    The exact weight term here keeps the sensitivities' signs (what the probes estimate; the exact analysis'
    default |a| |x| is an upper bound of it)."""
    monkeypatch.setattr(stores, "WEIGHT_TERM_SIGNED", True)
    monkeypatch.setattr(instrument, "ATTENTION_BLOCK_ELEMENTS", instrument.ATTENTION_BLOCK_ELEMENTS)  # restored
    rows, routes = _mean_ratios(family, tp, probes, seeds, blocked)
    sd = math.sqrt(2 / (probes * seeds))
    assert ((rows - 1).abs() <= ALLOWED_SD * sd).all(), f"mean V_hat / V per row {rows.tolist()} (sd {sd:.3f})"
    if family.startswith("moe"):
        assert routes is not None and len(routes) > 0, "no routing decision compared"
        assert ((routes - 1).abs() <= ALLOWED_SD * sd).all(), f"routing gaps: {routes.tolist()}"


def test_a_probe_missing_one_rounding_term_is_caught(monkeypatch):
    """The same statistic against a mutant: probes without the BF16 weight rounding (one term of the model, a
    quarter of the variance on this fixture) are outside the allowed spread."""
    import reference_impl.truth.probe_draws as draws

    monkeypatch.setattr(stores, "WEIGHT_TERM_SIGNED", True)
    original = draws.store_std
    monkeypatch.setattr(draws, "store_std", lambda *a, **k: (original(*a, **k)[0], None))
    rows, _ = _mean_ratios("dense-nvfp4", 1, 64, 12)
    assert ((rows - 1).abs() > ALLOWED_SD * math.sqrt(2 / (64 * 12))).any(), rows.tolist()


def test_default_weight_term_bounds_the_probes_estimate():
    """Without WEIGHT_TERM_SIGNED the exact analysis bounds the weight rounding by |a| |x|: at least the signed
    value the probes estimate (triangle inequality), so the golden snapshots' variances are never below it."""
    tm = TruthModel(str(FIXTURES / "dense-nvfp4-a"), "cpu")
    ids = list(range(3, 15))
    loose = _exact(tm, ids, 1)[1]
    stores.WEIGHT_TERM_SIGNED = True
    try:
        tight = _exact(tm, ids, 1)[1]
    finally:
        stores.WEIGHT_TERM_SIGNED = False
    assert (loose >= tight * (1 - 1e-12)).all() and (loose > tight).any()


def test_teacher_forced_is_memoised_and_judges_every_row():
    from reference_impl.truth.golden import ExactModel

    em = ExactModel(str(FIXTURES / "moe-nvfp4-a"), "cpu")
    prompt, cont = [5, 9, 11, 3], [7, 7, 2]
    first = em.teacher_forced(prompt, cont, probes=8)
    assert len(first.logprob) == len(prompt) + len(cont) - 1 and first.prompt_len == 4
    assert (first.logprob_var > 0).all() and first.routes
    gap_rows = (first.best != torch.tensor(first.tokens[1:])).nonzero()[:, 0].tolist()
    assert all(float(first.gap[r]) > 0 and float(first.gap_var[r]) > 0 for r in gap_rows)
    assert em.teacher_forced_many([(prompt, cont)], probes=8)[0] is first  # from memory, not recomputed
    with pytest.raises(ValueError):
        em.teacher_forced([], [1], probes=8)
