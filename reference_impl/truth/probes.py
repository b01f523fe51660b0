"""Variance proxies of every output at once, by forward-mode random probes: the truth at workload scale.

The rounding model (reference_impl/truth/golden.py) gives an engine's deviation of a quantity ``f`` as, to first order,
``d = sum_i s_i e_i`` over its rounding errors ``|e_i| <= u_i c_i`` (independent, mean zero), so ``d`` is
sub-Gaussian with variance proxy ``V = sum_i (s_i u_i c_i)^2`` (Hoeffding). :mod:`reference_impl.truth.engine`
computes ``V`` exactly with one batched backward per output: ``F`` outputs of a ``T``-token sequence cost ``F``
backward passes, ``O(F T)``, which rules out judging every position of long prompts.

Here every store gets a random *tangent* instead: ``u_i c_i g_i`` with ``g_i`` independent standard normal (one
variable per element; the rounded BF16 weight is one variable per weight element shared by the sequence's tokens,
``x (u |W| o G)^T``; an AWQ input one per input element). One forward-mode pass (``torch.autograd.forward_ad``)
carries them to every output at once: ``Z_f = sum_i s_i u_i c_i g_i``, exactly ``N(0, V_f)`` for every ``f``
whatever the sensitivities (a linear combination of independent Gaussians). ``K`` probes (``K`` replicas of the
sequence in one batch, each with its own draws) give ``V_hat = mean_k Z_fk^2`` with ``K V_hat / V ~ chi^2_K``.

**The bound** (:func:`probe_lambda`). A correct engine fails the check ``|d| <= LAMBDA_K sqrt(V_hat)`` with
probability ``P = E[P(|d| > LAMBDA_K sqrt(V_hat) | V_hat)] <= E[2 exp(-LAMBDA_K^2 V_hat / (2 V))]``
(Hoeffding, the probes independent of the engine's roundings) ``= 2 E[exp(-(LAMBDA_K^2 / 2K) X)]`` with
``X ~ chi^2_K``, whose moment generating function gives ``P <= 2 (1 + LAMBDA_K^2 / K)^(-K/2)``. Setting that to
the exact bound's risk ``2 exp(-LAMBDA^2 / 2)`` (``LAMBDA`` = 6: 3.0e-8 per quantity) gives
``LAMBDA_K^2 = K (exp(LAMBDA^2 / K) - 1)``: for ``K`` = 64, ``LAMBDA_K`` = 6.95 (the bound 16 % wider than with the
exact ``V`` at the same risk), 32: 8.16, 128: 6.45. Components with different units (BF16 ``2^-8``, fp32
accumulation ``2^-23``, the TPn partial sums) are one Gaussian per element with the summed variance, so ``V`` is
the quantity under the exact bound's square root. The estimate is unbiased (``E[V_hat] = V``);
tests/reference/test_truth_probes.py checks ``K V_hat / V`` against ``chi^2_K`` with the exact ``V`` of the fixtures.

**The screen** (:func:`screen_lambda`). Most checks of a correct engine sit far inside their bound, and ``K``
probes per sequence are most of the truth's cost. A check ``|x| <= LAMBDA_K sqrt(V_hat_K)`` (``x``: a deviation,
or a logit gap) is first screened with ``K1`` of the probes: ``|x| <= LAMBDA_S sqrt(V_hat_1)`` decides it within
bounds; any other outcome draws the other ``K2 = K - K1`` probes (independent draws) and the check is made with
``V_hat_K = (K1 V_hat_1 + K2 V_hat_2) / K``, a ``K``-probe estimate like any other. The screen only ever says
"within": a screened check fails exactly where the ``K``-probe check fails, so the false-failure risk is the
bound's own. The two verdicts differ only where the screen passes a check the ``K`` probes would fail: then
``LAMBDA_K^2 V_hat_K < LAMBDA_S^2 V_hat_1``, i.e. ``(V_hat_1 / V_hat_2) (K LAMBDA_S^2 - K1 LAMBDA_K^2) > K2
LAMBDA_K^2``, whose probability, whatever ``x`` and ``V``, is ``P(F(K1, K2) > c)`` with ``c = K2 LAMBDA_K^2 / (K
LAMBDA_S^2 - K1 LAMBDA_K^2)`` (``K1 V_hat_1 / V`` and ``K2 V_hat_2 / V`` independent ``chi^2``). ``LAMBDA_S`` is the
largest with that probability at most :data:`SCREEN_DISAGREEMENT` (1e-9 per check): for ``K1`` = 8 of 64, 3.10 (8 of 32: 4.32).

**Cost.** One forward of ``K`` replicas with tangents (each linear's primal once per sequence; per replica its
tangent and the weight term's product, two GEMMs as large as the forward's), independent of how many outputs are
judged: every position's logprob, every gap, every routing decision of the sequence.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time

import torch

from reference_impl.truth import pass_plan, probe_pass
from reference_impl.truth.instrument import slot
from reference_impl.truth.probe_draws import Probe, Probed
from reference_impl.truth.probe_pass import keeping_layers

# the probes' public face: the draws (probe_draws.py) and the pass (probe_pass.py) are its parts
__all__ = ["DEFAULT_PROBES", "PRECISIONS", "MAX_ROWS", "SCREEN_DISAGREEMENT", "Probe", "Probed", "f_tail",
           "joined_estimates", "keeping_layers", "probe_lambda", "probe_sequence", "probe_sequences", "route_outputs",
           "rows_budget", "screen_disagreement", "screen_lambda"]

#: each probed pass and the fp64 values' sweep, timed (the device synchronised), at INFO: where a truth's time goes
LOG = logging.getLogger("reference_impl.truth")

#: probes per sequence: the bound is 16 % wider than with the exact variance (module docstring)
DEFAULT_PROBES = 64
#: a probed pass's arithmetic: ``fp64`` (every value and estimate), or ``fp32`` (dense models: the values from an
#: fp64 forward, the variance estimates from an fp32 pass whose tangent GEMMs take BF16 operands,
#: :data:`reference_impl.truth.probe_pass.TANGENT_GEMM`; docs/truth.md measures the change of the estimates)
PRECISIONS = ("fp64", "fp32")


def probe_lambda(probes: int, base_lambda: float) -> float:
    """``LAMBDA_K``: the multiplier of ``sqrt(V_hat)`` from ``probes`` probes with the false-failure risk of
    ``base_lambda`` times the exact ``sqrt(V)`` (module docstring; the judges pass conformance/server/bounds.py's
    GOLDEN_LAMBDA, so both bounds share one risk)."""
    if probes < 1:
        raise ValueError(f"at least one probe, got {probes}")
    return math.sqrt(probes * math.expm1(base_lambda ** 2 / probes))


#: the most probability, per check, that the screen's verdict differs from the full ``K`` probes' (only ever a
#: check the ``K`` probes would fail, passed): far below the bound's own false-failure risk, 3.0e-8
SCREEN_DISAGREEMENT = 1e-9


def f_tail(c: float, d1: int, d2: int) -> float:
    """``P(F > c)`` for ``F ~ F(d1, d2)`` with ``d1`` even (exact: ``P(Beta(d1/2, d2/2) > x) = sum_{j < d1/2}
    Gamma(b + j) / (Gamma(b) j!) x^j (1 - x)^b``, ``x = d1 c / (d1 c + d2)``, ``b = d2 / 2``)."""
    if d1 < 2 or d1 % 2 or d2 < 1:
        raise ValueError(f"F({d1}, {d2}): d1 even and >= 2, d2 >= 1")
    if c <= 0:
        return 1.0
    x, b = d1 * c / (d1 * c + d2), d2 / 2
    log_terms = [math.lgamma(b + j) - math.lgamma(b) - math.lgamma(j + 1) + j * math.log(x) + b * math.log1p(-x)
                 for j in range(d1 // 2)]
    return min(1.0, sum(math.exp(t) for t in log_terms))


def screen_disagreement(screen: int, probes: int, lam_screen: float, lam: float) -> float:
    """The probability bound (module docstring, the screen) that a check screened with ``screen`` of ``probes``
    probes at ``lam_screen`` passes where the ``probes``-probe check at ``lam`` fails."""
    rest = probes - screen
    margin = probes * lam_screen ** 2 - screen * lam ** 2
    if margin <= 0:
        return 1.0
    return f_tail(rest * lam ** 2 / margin, screen, rest)


def screen_lambda(screen: int, probes: int, base_lambda: float,
                  disagreement: float = SCREEN_DISAGREEMENT) -> float:
    """``LAMBDA_S``: the largest screen multiplier of ``sqrt(V_hat)`` from ``screen`` of ``probes`` probes whose
    verdicts differ from the ``probes``-probe check's (``probe_lambda(probes, base_lambda)``) with probability at
    most ``disagreement`` (module docstring). ``screen``: even, fewer than ``probes``."""
    if screen < 2 or screen % 2 or screen >= probes:
        raise ValueError(f"a screen of {screen} of {probes} probes: it takes an even number, 2 or more, fewer than "
                         f"the probes")
    lam = probe_lambda(probes, base_lambda)
    lo, hi = lam * math.sqrt(screen / probes), lam  # the disagreement grows with LAMBDA_S from 0 at lo
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if screen_disagreement(screen, probes, mid, lam) <= disagreement else (lo, mid)
    return lo


def joined_estimates(first, more):
    """One sequence's answer (a :class:`reference_impl.truth.golden.TeacherForced`) from the probes of ``first``
    and of ``more`` (independent draws of the same sequence, e.g. after a screen): the variance estimates are means
    of squares, averaged by the probes; the values are ``first``'s."""
    if list(first.tokens) != list(more.tokens) or first.tp != more.tp:
        raise ValueError("estimates of different sequences (or TP sizes) cannot be joined")
    k = first.probes + more.probes

    def mean(a, b):
        return (a * first.probes + b * more.probes) / k
    extra = {(t, s): v for t, s, _, v in more.routes}
    if set(extra) != {(t, s) for t, s, _, _ in first.routes}:
        raise ValueError("the two passes' routing decisions differ: not one sequence's estimates")
    routes = [(t, s, gap, mean(v, extra[(t, s)])) for t, s, gap, v in first.routes]
    return dataclasses.replace(first, logprob_var=mean(first.logprob_var, more.logprob_var),
                               gap_var=mean(first.gap_var, more.gap_var), routes=routes, probes=k)


def _joined(parts: list[Probed]) -> Probed:
    """One sequence's probes from passes over groups of its replicas (the same primal in each): the variance
    estimates are means of squares, so the groups' are averaged by their sizes."""
    k = sum(p.probes for p in parts)

    def mean(values):
        return sum(v * p.probes for v, p in zip(values, parts)) / k
    first = parts[0]
    routes = [(d, gaps, mean([p.routes[n][2] for p in parts])) for n, (d, gaps, _) in enumerate(first.routes)]
    return Probed(first.logprob, mean([p.logprob_var for p in parts]), first.best, first.gap,
                  mean([p.gap_var for p in parts]), k, routes)


#: batch rows (sequences x replicas x tokens) of one probed pass at most: 65536 on the fixtures; larger models
#: take fewer (:func:`rows_budget`)
MAX_ROWS = 1 << 16
#: fp64 bytes one activation of a probed pass may take (its primal; the tangent, draws and error weights beside
#: it make a pass's peak several times this: 29 GiB on an H100 for the 8B shape at 16384 rows)
ACTIVATION_BYTES = 2 << 30


def rows_budget(cfg, dtype: torch.dtype = torch.float64) -> int:
    """Rows of one probed pass: MAX_ROWS, fewer where the widest activation (the MLP's) would exceed
    ACTIVATION_BYTES."""
    width = max(cfg.hidden_size, cfg.intermediate_size or 0, (cfg.moe_intermediate_size or 0) * max(1, cfg.top_k or 1))
    return max(1, min(MAX_ROWS, ACTIVATION_BYTES // (dtype.itemsize * width)))


def probe_sequences(truth, seqs: list[list[int]], targets: list[list[int]], probes: int = DEFAULT_PROBES, tp: int = 1,
                    seed: int = 0, max_rows: int | None = None, precision: str = "fp64") -> list[Probed]:
    """Forward-mode probes of each sequence through ``truth`` (a :class:`reference_impl.truth.engine.TruthModel`),
    judged against ``targets`` (one token per position): sequences of equal length share a pass (at most
    ``max_rows`` rows; in fp32 also sequences of nearby lengths, right-padded: reference_impl/truth/pass_plan.py),
    the layers one at a time (weights streamed once per pass), ``probes`` replicas of each. The draws depend on
    ``seed`` and the batching. ``precision``: :data:`PRECISIONS`."""
    if precision not in PRECISIONS:
        raise ValueError(f"probe precision {precision!r}: one of {', '.join(PRECISIONS)}")
    if precision != "fp64" and truth.cfg.top_k:
        raise ValueError(f"probe precision {precision!r} is for dense models (an fp32 pass may route a near-tie "
                         f"otherwise than the fp64 values it estimates for); this one routes: use fp64")
    if precision != "fp64":
        with probe_pass.fast_fp32(truth.device):
            return _probe_sequences(truth, seqs, targets, probes, tp, seed, max_rows, torch.float32)
    return _probe_sequences(truth, seqs, targets, probes, tp, seed, max_rows, torch.float64)


def _probe_sequences(truth, seqs, targets, probes, tp, seed, max_rows, dtype) -> list[Probed]:
    max_rows = max_rows or rows_budget(truth.cfg, dtype)
    out: list[Probed | None] = [None] * len(seqs)
    by_length: dict[int, list[int]] = {}
    for i, s in enumerate(seqs):
        by_length.setdefault(len(s), []).append(i)
    values = {}
    if dtype != torch.float64:
        with _timed(truth.device, lambda: f"fp64 values: {len(seqs)} sequences, {sum(map(len, seqs))} rows"):
            values = _values(truth, seqs, targets, by_length)
    # an fp32 pass's values come from the unpadded fp64 forward: nearby lengths may share its passes, padded
    # (reference_impl/truth/pass_plan.py); an fp64 pass's values are its own: each length alone
    groups = (pass_plan.plan({t: len(i) for t, i in by_length.items()}, probes, max_rows) if values
              else [(t, [t]) for t in by_length if probes * t <= max_rows])
    grouped = {t for _, ts in groups for t in ts}
    for t, idx in sorted(by_length.items()):
        if t in grouped:
            continue
        group = max(1, min(probes, max_rows // t))  # replicas per pass
        for i in idx:  # a long sequence: its replicas in groups, independent draws each (seeded apart)
            with _timed(truth.device, lambda: f"pass: 1 x {t} rows x {probes} probes ({group} per pass)"):
                parts = [probe_pass.run_pass(truth, [seqs[i]], [targets[i]], min(group, probes - lo), tp,
                                             seed + 7919 * (lo // group + 1), dtype, [values[i]] if values else None)[0]
                         for lo in range(0, probes, group)]
            out[i] = _joined(parts)
    for t, lengths in sorted(groups):
        idx = [i for length in lengths for i in by_length[length]]
        per = max(1, max_rows // (probes * t))
        for lo in range(0, len(idx), per):
            part = idx[lo:lo + per]
            s_, t_ = [_padded(seqs[i], t) for i in part], [_padded(targets[i], t) for i in part]
            v_ = [_padded_values(values[i], t) for i in part] if values else None
            with _timed(truth.device, lambda: f"pass: {len(part)} x {t} rows x {probes} probes (lengths "
                                              f"{min(lengths)}-{max(lengths)})"):
                passed = probe_pass.run_pass(truth, s_, t_, probes, tp, seed, dtype, v_)
            for i, p in zip(part, passed):
                out[i] = _trimmed(p, len(seqs[i]))
    return out


@contextlib.contextmanager
def _timed(device: torch.device, what):
    """Log ``what()`` and the block's wall time at INFO (the device synchronised: costs a sync, so only when
    enabled)."""
    if not LOG.isEnabledFor(logging.INFO):
        yield
        return
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    yield
    sync()
    LOG.info("%.2f s  %s", time.perf_counter() - t0, what())


def _padded(ids: list[int], length: int) -> list[int]:
    """``ids`` right-padded to ``length`` (token 0: a padded position never reaches a real one)."""
    return list(ids) + [0] * (length - len(ids))


def _padded_values(values: tuple, length: int) -> tuple:
    return tuple(torch.cat([v, v.new_zeros(length - len(v))]) for v in values)


def _trimmed(p: Probed, length: int) -> Probed:
    """A padded sequence's probes at its own positions."""
    if len(p.logprob) == length:
        return p
    return Probed(p.logprob[:length], p.logprob_var[:length], p.best[:length], p.gap[:length], p.gap_var[:length],
                  p.probes, [(d, gaps[:length], var[:length]) for d, gaps, var in p.routes])


def _values(truth, seqs, targets, by_length: dict[int, list[int]]) -> dict[int, tuple]:
    """Each sequence's fp64 values for an fp32 pass, from one fp64 sweep of the layers over every length (each
    length in batches as large as an fp64 pass's rows allow): a layer is decoded in fp64 once for all of them."""
    rows = rows_budget(truth.cfg, torch.float64)
    batches = [idx[lo:lo + max(1, rows // t)] for t, idx in by_length.items()
               for lo in range(0, len(idx), max(1, rows // t))]
    got = probe_pass.values_fp64(truth, [([seqs[i] for i in b], [targets[i] for i in b]) for b in batches])
    return {i: v for b, vs in zip(batches, got) for i, v in zip(b, vs)}


def probe_sequence(truth, ids: list[int], targets: list[int], probes: int = DEFAULT_PROBES, tp: int = 1,
                   seed: int = 0) -> Probed:
    return probe_sequences(truth, [ids], [targets], probes, tp, seed)[0]



def route_outputs(cfg, probed: Probed) -> list[tuple[int, int, float, float]]:
    """Every finite routing decision: ``(position, slot, gap, V_hat)``."""
    out = []
    for d, gaps, var in probed.routes:
        s = slot(cfg, d.layer, d.kind)
        for pos in torch.isfinite(gaps).nonzero()[:, 0].tolist():
            out.append((pos, s, float(gaps[pos]), float(var[pos])))
    return out

