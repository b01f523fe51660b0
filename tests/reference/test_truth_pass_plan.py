"""Sequences of nearby lengths sharing an fp32 probed pass, right-padded (reference_impl/truth/pass_plan.py): the
plan is the cheapest grouping, and padding leaves every real position's pass exactly as it was (causal: a padded
position never reaches a real one)."""
from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

import reference_impl.truth.probe_pass as probe_pass
import reference_impl.truth.probes as probes
from reference_impl.truth import pass_plan
from reference_impl.truth.engine import TruthModel

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "checkpoints"


def _cost(groups, counts, probes_, max_rows, overhead):
    total = 0
    for top, lengths in groups:
        n = sum(counts[t] for t in lengths)
        total += math.ceil(n / max(1, max_rows // (probes_ * top))) * overhead + n * probes_ * top
    return total


def _brute_force(counts, probes_, max_rows, overhead):
    lengths = sorted(t for t in counts if probes_ * t <= max_rows)
    best = math.inf
    for cuts in itertools.product((False, True), repeat=max(0, len(lengths) - 1)):
        groups, run = [], [lengths[0]]
        for t, cut in zip(lengths[1:], cuts):
            if cut:
                groups.append((run[-1], run))
                run = []
            run.append(t)
        groups.append((run[-1], run))
        best = min(best, _cost(groups, counts, probes_, max_rows, overhead))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_the_plan_is_the_cheapest_grouping(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 400, (8,), generator=g).unique().tolist()
    counts = {t: int(c) for t, c in zip(lengths, torch.randint(1, 40, (len(lengths),), generator=g))}
    probes_, max_rows, overhead = 8, 16384, int(torch.randint(0, 8192, (1,), generator=g))
    groups = pass_plan.plan(counts, probes_, max_rows, overhead)
    fits = sorted(t for t in counts if probes_ * t <= max_rows)
    assert sorted(t for _, ts in groups for t in ts) == fits  # every length that fits, once
    assert all(top == max(ts) for top, ts in groups)  # padded to the group's longest, never beyond
    assert _cost(groups, counts, probes_, max_rows, overhead) == _brute_force(counts, probes_, max_rows, overhead)


def test_no_overhead_no_padding_and_long_sequences_left_alone():
    counts = {5: 3, 9: 1, 40: 2, 5000: 1}
    assert pass_plan.plan(counts, 8, 1 << 14, 0) == [(5, [5]), (9, [9]), (40, [40])]  # 8 x 5000 > 16384
    assert pass_plan.plan(counts, 8, 1 << 14, 1 << 20) == [(40, [5, 9, 40])]


def _own_values(monkeypatch):
    """The padded passes' own fp32 values at the trimmed positions (not the unpadded fp64 forward's), and the
    lengths each pass ran at."""
    ran = []
    real = probe_pass.run_pass

    def run_pass(truth, seqs, targets, k, tp, seed, dtype, values=None):
        ran.append(sorted({len(s) for s in seqs}))
        return real(truth, seqs, targets, k, tp, seed, dtype, None)
    monkeypatch.setattr(probe_pass, "run_pass", run_pass)
    return ran


def test_padding_leaves_real_positions_as_they_were(monkeypatch):
    """Lengths 9, 14 and 30 share one padded pass; each sequence's fp32 values from that pass, at its own
    positions, are the fp64 forward's to fp32 rounding (1e-4 of a logprob: fp32 products over this fixture's
    widths; a misaligned or left-padded sequence is off by O(1), the mutant below), and its estimates are
    positive and finite."""
    tm = TruthModel(str(FIXTURES / "dense-nvfp4-a"), "cpu")
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, tm.cfg.vocab_size, (t,), generator=g).tolist() for t in (9, 14, 30)]
    targets = [s[1:] + [s[0]] for s in seqs]
    exact = probes.probe_sequences(tm, seqs, targets, 4)  # fp64: each length alone, its own values
    ran = _own_values(monkeypatch)
    got = probes.probe_sequences(tm, seqs, targets, 4, precision="fp32")
    assert ran == [[30]], ran  # one pass, every sequence padded to 30
    for e, p, s in zip(exact, got, seqs):
        assert len(p.logprob) == len(s) and len(p.logprob_var) == len(s)
        assert torch.allclose(p.logprob.double(), e.logprob, rtol=0, atol=1e-4)
        assert torch.equal(p.best, e.best)
        assert bool((p.logprob_var > 0).all()) and bool(p.logprob_var.isfinite().all())


def test_a_left_padded_pass_is_caught(monkeypatch):
    """The same comparison against a mutant padding on the left: its real positions see the padding first."""
    monkeypatch.setattr(probes, "_padded", lambda ids, length: [0] * (length - len(ids)) + list(ids))
    monkeypatch.setattr(probes, "_trimmed", lambda p, length: probes.Probed(
        *(x[len(x) - length:] for x in (p.logprob, p.logprob_var, p.best, p.gap, p.gap_var)), p.probes, p.routes))
    with pytest.raises(AssertionError):
        test_padding_leaves_real_positions_as_they_were(monkeypatch)
