"""The MoE experts' weight term drawn from its covariance (reference_impl/truth/probe_draws.py ``_few_rows``):
for the ``n`` rows of one sequence an expert receives, column ``j`` of ``x (dW o G)^T`` is ``N(0, C_j)`` with
``C_j = X diag(u^2 |W_j|^2) X^T``; the draws must have that covariance, rows' correlations included (the same
weight's rounding reaches every token of the sequence)."""
from __future__ import annotations

import math

import pytest
import torch

from reference_impl.truth.probe_draws import Probe
from reference_impl.truth.stores import U_BF16

REPLICAS, ROWS, K_IN, N = 4000, 3, 16, 5


def _case():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(ROWS, K_IN, generator=g, dtype=torch.float64)
    base[1] = base[0] + 0.1 * base[1]  # two tokens nearly alike: their weight terms nearly the same
    w_abs = torch.rand(N, K_IN, generator=g, dtype=torch.float64) + 0.1
    x = base.repeat(REPLICAS, 1)  # replica r's rows at r * ROWS ...: every replica routes the same tokens
    replica = torch.arange(REPLICAS).repeat_interleave(ROWS)
    pos = torch.arange(ROWS).repeat(REPLICAS)
    return base, w_abs, x, replica, pos


def _drawn(few_rows=Probe._few_rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    base, w_abs, x, replica, pos = _case()
    probe = Probe(REPLICAS, 7, generator=torch.Generator().manual_seed(1))
    out = x.new_zeros(x.shape[0], N)
    assert few_rows(probe, x, w_abs, torch.ones_like(replica, dtype=torch.bool), replica, pos, out)
    samples = out.view(REPLICAS, ROWS, N)
    expected = torch.einsum("tc,sc,nc->nts", base, base, (U_BF16 * w_abs) ** 2)
    got = torch.einsum("ktn,ksn->nts", samples, samples) / REPLICAS
    return got, expected, samples


def _worst_sd(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest |got - expected| over its sampling standard deviation, sqrt((C_tt C_ss + C_ts^2) / K)."""
    d = torch.diagonal(expected, dim1=1, dim2=2)
    sd = ((d[:, :, None] * d[:, None, :] + expected ** 2) / REPLICAS).sqrt()
    return float(((got - expected).abs() / sd).max())


def test_the_draws_have_the_weight_terms_covariance():
    got, expected, _ = _drawn()
    assert _worst_sd(got, expected) <= 4.5  # 15 entries x 5 columns: a correct draw passes with room
    corr = expected[:, 0, 1] / (expected[:, 0, 0] * expected[:, 1, 1]).sqrt()
    assert bool((corr > 0.9).all())  # the case does test the rows' correlation


def test_rows_drawn_independently_are_caught():
    """Mutant: each row's weight term drawn alone (the right variance, no correlation between the tokens)."""
    def independent(self, x, w_abs, of_seq, replica, pos, out):
        k, n = self.replicas, ROWS
        var = (x[:n] ** 2) @ ((U_BF16 * w_abs) ** 2).T  # [n, N]
        out[:] = (self._randn((k, n, w_abs.shape[0]), x) * var.sqrt()).reshape(k * n, -1)
        return True
    got, expected, _ = _drawn(independent)
    assert _worst_sd(got, expected) > 10


def test_it_applies_only_where_every_replica_routes_the_same_few_tokens():
    base, w_abs, x, replica, pos = _case()
    probe = Probe(REPLICAS, 7)
    out = x.new_zeros(x.shape[0], N)
    moved = pos.clone()
    moved[-1] = 6  # the last replica routes another token here
    assert not probe._few_rows(x, w_abs, torch.ones_like(replica, dtype=torch.bool), replica, moved, out)
    few = Probe(2, 7)  # more rows than replicas: the product is cheaper
    sel = replica < 2
    assert not few._few_rows(x[sel], w_abs, torch.ones(int(sel.sum()), dtype=torch.bool), replica[sel], pos[sel],
                             x.new_zeros(int(sel.sum()), N))
    assert math.isclose(float(out.abs().sum()), 0.0)
