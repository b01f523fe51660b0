"""Which sequences share an fp32 probed pass (:func:`reference_impl.truth.probes.probe_sequences`): sequences of
nearby lengths share one, the shorter right-padded to the longest.

A pass has fixed costs whatever its rows (every linear's weight-rounding draws, ``K x N x K_in`` normals; the
layers decoded; the launches), about as much as :data:`PASS_OVERHEAD_ROWS` rows of work: a workload's many single
prompts of distinct short lengths (one pass each) cost mostly that. Padding is exact for the estimates: attention
is causal, so a padded position never reaches a real one (its stores' draws only move padded rows), and a real
position's stores and the sequence's shared weight draws are those of its own pass. The values are not padded
(an fp32 pass takes them from the unpadded fp64 forward)."""
from __future__ import annotations

import math

#: the fixed costs of one probed pass in rows of work (sequence x replica x token): on the 8B shape on an H100,
#: a single short sequence's pass takes about 0.65 s beyond its rows, the time of about 3,800 rows of the pool's
#: (1.38 ms per 8-replica token); rounded up to a power of two
PASS_OVERHEAD_ROWS = 4096


def plan(counts: dict[int, int], probes: int, max_rows: int,
         overhead_rows: int | None = None) -> list[tuple[int, list[int]]]:
    """The padded length of each group of lengths: ``[(padded_length, lengths), ...]`` covering every length of
    ``counts`` (length -> sequences of it) that fits a pass with all its ``probes`` (``probes x length <=
    max_rows``; longer ones are left out: their replicas take passes of their own). The groups are contiguous
    runs of the sorted lengths that minimise ``sum over passes (overhead_rows + rows)``, a group's passes holding
    ``max_rows // (probes x padded_length)`` sequences each (exact: dynamic programming over the runs).
    ``overhead_rows``: default :data:`PASS_OVERHEAD_ROWS` (0: no padding, each length its own passes)."""
    overhead_rows = PASS_OVERHEAD_ROWS if overhead_rows is None else overhead_rows
    lengths = sorted(t for t in counts if probes * t <= max_rows)
    best = [0.0] + [math.inf] * len(lengths)  # best[j]: the cheapest plan of the first j lengths
    start = [0] * (len(lengths) + 1)
    for j in range(1, len(lengths) + 1):
        top = lengths[j - 1]
        per = max(1, max_rows // (probes * top))
        n = 0
        for i in range(j, 0, -1):  # the group lengths[i-1 .. j-1], padded to top
            n += counts[lengths[i - 1]]
            cost = best[i - 1] + math.ceil(n / per) * overhead_rows + n * probes * top
            if cost < best[j]:
                best[j], start[j] = cost, i - 1
    groups, j = [], len(lengths)
    while j:
        i = start[j]
        groups.append((lengths[j - 1], lengths[i:j]))
        j = i
    return groups[::-1]
