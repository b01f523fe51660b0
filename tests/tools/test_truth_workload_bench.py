"""benchmarks/truth_workload.py (``bench_truth.py --workload``): the order a budget measures the sequences in, the
projection from what it measured, and one short run on the fixture end to end."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.truth_workload import _interleaved, _projection, judged_sequences
from conformance.server.workloads import load

REPO = Path(__file__).resolve().parents[2]


def test_every_length_is_reached_before_any_second_chunk():
    groups = {("a", 80): list(range(10)), ("a", 5): [0], ("b", 80): list(range(3)), ("a", 300): [0]}
    order = [(key, len(part)) for key, part in _interleaved(groups, 4)]
    assert order[:4] == [(("a", 5), 1), (("a", 80), 4), (("b", 80), 3), (("a", 300), 1)]
    assert order[4:] == [(("a", 80), 4), (("a", 80), 2)]


def test_projection_takes_each_length_at_its_own_rate_or_the_nearest_measured():
    seqs = {("a", 10): [object(), object()], ("a", 100): [object()], ("a", 1000): [object()]}
    flops = {id(x): 1.0 * key[1] for key, g in seqs.items() for x in g}
    measured = {("a", 10): [2.0, 10.0], ("a", 1000): [50.0, 1000.0]}  # 0.2 and 0.05 s per floor FLOP
    # 10-token group: 0.2 x 20; 100 (not reached, nearest 10... and 1000: 90 vs 900 away): 0.2 x 100; 1000: 50
    assert _projection(seqs, flops, measured, wall=60.0) == pytest.approx(4.0 + 20.0 + 50.0 + (60.0 - 52.0))


def test_weight_set_b_gets_continuations_of_its_own():
    """b's pool shares a's prompts, not a's (prompt, continuation) pairs: those would be memoised answers."""
    seqs = judged_sequences(load("quick"), 128)
    a, b = {tuple(p + c) for p, c in seqs["a"]}, [tuple(p + c) for p, c in seqs["b"]]
    assert b and not any(x in a for x in b)


@pytest.mark.integration
def test_a_short_run_prints_its_table(tmp_path):
    r = subprocess.run([sys.executable, "benchmarks/bench_truth.py", "--workload", "quick", "--budget-s", "2",
                        "--chunk", "16"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    row = r.stdout.strip().splitlines()[-1]
    assert row.startswith("| quick | fp64 | 8 (screen) of 32 |"), r.stdout[-2000:]
    assert "projected" in r.stderr  # the progress lines


@pytest.mark.integration
def test_a_whole_run_does_every_sequence_in_one_call_per_weight_set():
    """``--chunk 0``: each weight set's sequences in one call (as the workload judge asks): every sequence done,
    the projection is the measured time; ``--trace`` times each probed pass and each values' sweep."""
    r = subprocess.run([sys.executable, "benchmarks/bench_truth.py", "--workload", "quick", "--chunk", "0",
                        "--precision", "fp32", "--trace"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    cells = [c.strip() for c in r.stdout.strip().splitlines()[-1].split("|")[1:-1]]
    total, done = cells[3].split(" (")
    assert done == total + ")", cells  # every sequence
    assert f"{float(cells[8]):.0f}" == cells[10], cells  # projected = measured
    assert "weight set a" in r.stderr and "weight set b" in r.stderr
    passes = re.findall(r"\] +[0-9.]+ s  pass: (\d+) x (\d+) rows x 8 probes", r.stderr)
    assert passes and re.search(r"\] +[0-9.]+ s  fp64 values: \d+ sequences", r.stderr), r.stderr[-2000:]
