"""The workload scenarios' coverage: each judged row's planned forward (phase and token-count bucket), the per-cell
counts and accuracy figures, the coverage map (JSON, Markdown, a PNG heat map) and the failure message
(conformance/server/workload_judge.py fills it)."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from conformance.server.workloads import PHASES, bucket, buckets_up_to

MAX_REPORTED = 8  # failing rows named in a failure message (all of them are in the coverage file)


@dataclass
class Planned:
    """One answer to judge: which request it was, and the token counts of the forwards that computed it as the
    workload plans them (``mixed``: traffic whose forwards the engine's scheduler composes, counted in the
    'mixed' row at the long prompt's length)."""

    request: str
    weight_set: str
    prefill_m: int
    decode_m: int
    mixed: bool = False

    def cell(self, phase: str) -> tuple[str, str]:
        if self.mixed:
            return "mixed", bucket(self.prefill_m)
        return phase, bucket(self.prefill_m if phase == "prefill" else self.decode_m)


@dataclass
class Row:
    request: str
    phase: str
    bucket: str
    row: int
    check: str
    engine: float
    reference: float
    bound: float
    detail: str = ""

    def describe(self) -> str:
        return (f"{self.phase} M {self.bucket}, {self.request}, position {self.row}: {self.check} {self.detail}"
                f"engine {self.engine:.6f} vs reference {self.reference:.6f} (bound {self.bound:.3e}, "
                f"{abs(self.engine - self.reference) / self.bound if self.bound else math.inf:.1f}x)")


@dataclass
class Cell:
    judged: int = 0
    failed: int = 0
    worst_ratio: float = 0.0
    nll_delta_sum: float = 0.0   # sum of (reference logprob - engine logprob) over logprob checks
    top1_mismatch: int = 0       # generated tokens that are not the reference's best
    generated: int = 0
    explained: int = 0           # outside the smooth bound, within it on a branch of near-tie routings


@dataclass
class Coverage:
    """Per (phase, bucket): rows judged, failed, worst bound ratio, mean delta NLL, top-1 mismatch rate."""

    workload: str
    expected: set = field(default_factory=set)  # (phase, bucket) the plan sends
    cells: dict = field(default_factory=dict)
    failures: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: the screen's counts (WorkloadJudge): answers decided on its probes, answers that drew the rest
    screen: dict | None = None

    def cell(self, phase: str, b: str) -> Cell:
        return self.cells.setdefault((phase, b), Cell())

    def expect(self, p: Planned) -> None:
        self.expected |= {p.cell("prefill"), p.cell("decode")}

    def not_reached(self) -> list[tuple[str, str]]:
        return sorted(k for k in self.expected if self.cells.get(k, Cell()).judged == 0)

    @property
    def judged(self) -> int:
        return sum(c.judged for c in self.cells.values())

    def as_dict(self) -> dict:
        rows = []
        largest = max((_largest_count(b) for _, b in self.expected | set(self.cells)), default=1)
        for phase in PHASES:
            for b in buckets_up_to(largest):
                c = self.cells.get((phase, b))
                status = ("failed" if c and c.failed else "passed" if c and c.judged else
                          "not reached" if (phase, b) in self.expected else "not planned")
                entry = {"phase": phase, "bucket": b, "status": status}
                if c and c.judged:
                    entry |= {"judged": c.judged, "failed": c.failed, "near_tie_branches": c.explained,
                              "worst_bound_ratio": round(c.worst_ratio, 4),
                              "mean_delta_nll": c.nll_delta_sum / c.judged,
                              "top1_mismatch_rate": (c.top1_mismatch / c.generated) if c.generated else None}
                rows.append(entry)
        return {"workload": self.workload, "judged": self.judged, "failed": len(self.failures),
                "cells": rows, "failures": [asdict(r) for r in self.failures[:200]], "notes": self.notes,
                "screen": self.screen}

    def markdown(self) -> str:
        d = self.as_dict()
        lines = [f"### Coverage of workload `{self.workload}`: {d['judged']} positions judged, {d['failed']} failed",
                 "", "| phase | tokens in the forward (M) | status | judged | failed | on a near-tie branch | "
                 "worst bound ratio | mean delta NLL | top-1 mismatch |", "|---|---|---|---|---|---|---|---|---|"]
        for e in d["cells"]:
            if e["status"] == "not planned":
                continue
            mm = e.get("top1_mismatch_rate")
            lines.append(f"| {e['phase']} | {e['bucket']} | {e['status']} | {e.get('judged', 0)} | "
                         f"{e.get('failed', 0)} | {e.get('near_tie_branches', '')} | {e.get('worst_bound_ratio', '')} | "
                         f"{'' if 'mean_delta_nll' not in e else format(e['mean_delta_nll'], '.2e')} | "
                         f"{'' if mm is None else format(mm, '.3f')} |")
        if self.screen:
            sc = self.screen
            lines += ["", f"The truth's screen ({sc['probes']} of {sc['of']} probes first, threshold "
                          f"{sc['lambda']} sqrt(V_hat)): {sc['decided']} answers decided on it, {sc['drew_the_rest']} "
                          f"drew the rest (worst bound ratios of screened answers use their {sc['probes']}-probe "
                          f"estimates)."]
        return "\n".join(lines) + "\n"

    def write(self, directory: Path, stem: str) -> list[Path]:
        """``<stem>.json``, ``<stem>.md`` and, when matplotlib is installed, ``<stem>.png`` (the heat map)."""
        directory.mkdir(parents=True, exist_ok=True)
        out = [directory / f"{stem}.json", directory / f"{stem}.md"]
        out[0].write_text(json.dumps(self.as_dict(), indent=2) + "\n")
        out[1].write_text(self.markdown())
        png = _heat_map(self.as_dict(), directory / f"{stem}.png")
        return out + ([png] if png else [])


def _largest_count(b: str) -> int:
    """The largest token count of bucket ``b`` ('3-4' -> 4, '>16384' -> 16385)."""
    return int(b[1:]) + 1 if b.startswith(">") else int(b.split("-")[-1])


def _heat_map(d: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    buckets = list(dict.fromkeys(e["bucket"] for e in d["cells"]))
    colour = {"passed": 0.0, "not planned": 0.5, "not reached": 0.75, "failed": 1.0}
    grid = [[colour[e["status"]] for e in d["cells"] if e["phase"] == phase] for phase in PHASES]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(buckets)), 2.4))
    ax.imshow(grid, cmap="RdYlGn_r", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(buckets)), buckets, rotation=60, fontsize=7)
    ax.set_yticks(range(len(PHASES)), PHASES)
    for y, phase in enumerate(PHASES):
        for x, e in enumerate(e for e in d["cells"] if e["phase"] == phase):
            text = str(e.get("judged", "")) if e["status"] in ("passed", "failed") else e["status"][:3]
            ax.text(x, y, text, ha="center", va="center", fontsize=6)
    ax.set_title(f"workload {d['workload']}: positions judged per (phase, tokens in the forward)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def failure_message(coverage: Coverage, what: str) -> str:
    rows = coverage.failures
    by_cell: dict[tuple[str, str], int] = {}
    for r in rows:
        by_cell[(r.phase, r.bucket)] = by_cell.get((r.phase, r.bucket), 0) + 1
    cells = ", ".join(f"{p} M {b}: {n}" for (p, b), n in sorted(by_cell.items()))
    head = "\n  ".join(r.describe() for r in rows[:MAX_REPORTED])
    return (f"{what}: {len(rows)} of {coverage.judged} positions outside the reference's bounds ({cells}); "
            f"first ones:\n  {head}\n(conformance/server/workload_judge.py; bounds from "
            f"reference_impl/truth/probes.py)")
