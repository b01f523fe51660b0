"""Golden truth for the server scenarios: the reference model's greedy outputs for :data:`PROMPTS`, and the
comparison of a server's generations with them.

Where the golden outputs come from (see :mod:`reference_impl.golden` for what they hold):

* fixture checkpoints: syrupy snapshots ``fixtures/snapshots/test_server_golden/test_server_golden[<family>-
  <set>].tensors.json``, written by ``pytest tests/test_server_golden.py --snapshot-update`` and
  re-checked against the reference by that test module; each records the digest of the checkpoint it was
  made from, so a changed fixture is an error, not a silent mismatch;
* a user's checkpoint (``--server-checkpoint``): computed by the reference model at session start.

The comparison (:func:`compare_with_golden`), per prompt and step: the token ids must be identical up to
the first step where the engine picks another token; that step is a legitimate divergence only if the
reference's logit gap between its token and the engine's is inside the derived bound
(:func:`conformance.server.bounds.golden_bound`), and the comparison of that prompt stops there. Every
compared logprob must be within its own bound. A MoE routing decision whose router-logit gap is inside
its bound may legitimately route differently: steps after it are not compared.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..snapshots import Approx, deserialize_entries, snapshot_root
from .bounds import golden_bound
from .client import Generation

PROMPTS = ("the city of water", "a new river and the old stone tree", "music of the sea and the moon",
           "people of the north")
MAX_NEW_TOKENS = 8
GREEDY = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
SNAPSHOT_TEST = "test_server_golden"
# Golden values are fp64 with fp32 transcendentals (rotary angles, softmaxes) that may differ by an fp32 ulp
# (2^-23 relative) between CPU math libraries; through these models' sensitivities (|d logprob / d v| * |v|
# summed over a store is < 50 on the fixtures) that moves a logprob or a gap by < 1e-5. Variance proxies are
# sums of squares of the same quantities: relative 1e-5.
VALUE_ATOL = 1e-5
VARIANCE_RTOL = 1e-5


def snapshot_path(family: str, weight_set: str) -> Path:
    return snapshot_root() / SNAPSHOT_TEST / f"{SNAPSHOT_TEST}[{family}-{weight_set}].tensors.json"


# ----------------------------------------------------------------------------------------- (de)serialization
def golden_entries(g, prompts: tuple[str, ...] = PROMPTS) -> dict:
    """Snapshot entries of a :class:`reference_impl.golden.GoldenSet` (ids exact, floats within the
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
    from reference_impl.golden import GoldenSet

    n = len([k for k in entries if k.startswith("prompt_ids_")])
    return GoldenSet(entries["checkpoint_digest"], [entries[f"prompt_ids_{i}"].tolist() for i in range(n)],
                     entries["output_ids"], entries["logprobs"], entries["logprob_var"], entries["top_ids"],
                     entries["top_gaps"], entries["route_gaps"], entries["route_var"])


def load_fixture_golden(family: str, weight_set: str):
    path = snapshot_path(family, weight_set)
    if not path.is_file():
        raise FileNotFoundError(f"no golden snapshot for fixture {family}-{weight_set} ({path}); make it with "
                                f"`python -m pytest tests/test_server_golden.py --snapshot-update`")
    return golden_from_entries(deserialize_entries(path.read_text()))


# ----------------------------------------------------------------------------------------- truth of one weight set
@dataclass
class GoldenTruth:
    """The golden outputs of one checkpoint directory, and (loaded on demand) the reference model that can
    answer for a token the stored top-K does not hold."""

    label: str
    path: str
    golden: object  # reference_impl.golden.GoldenSet
    _exact: object = field(default=None, repr=False)

    def gap(self, prompt: int, step: int, token: int) -> tuple[float, torch.Tensor]:
        """(logit gap, variance proxies) between the reference's token at ``step`` and ``token``, computed by
        the reference model (only needed where an engine diverges)."""
        g = self.golden
        if self._exact is None:
            from reference_impl.golden import ExactModel

            self._exact = ExactModel(self.path)
            if self._exact.digest != g.checkpoint_digest:
                raise AssertionError(f"{self.path}: the checkpoint changed since its golden outputs were made")
        return self._exact.gap_variance(g.prompt_ids[prompt], g.output_ids[prompt].tolist(), step, token)


@dataclass
class GoldenResult:
    compared: int = 0           # tokens compared
    worst_ratio: float = 0.0    # max |logprob - golden| / bound over compared tokens
    notes: list[str] = field(default_factory=list)

    def add(self, other: "GoldenResult") -> None:
        self.compared += other.compared
        self.worst_ratio = max(self.worst_ratio, other.worst_ratio)
        self.notes += other.notes


def comparable_steps(g, prompt: int, tp: int) -> tuple[int, str]:
    """How many steps of ``prompt`` can be compared: all, unless a routing decision at or before a step's
    position is inside its bound (a correct engine may route that token differently)."""
    gaps, var = g.route_gaps[prompt], g.route_var[prompt]
    finite = torch.isfinite(gaps)
    if not bool(finite.any()):
        return g.max_new_tokens, ""
    near = finite & (gaps <= golden_bound(var, tp))
    if not bool(near.any()):
        return g.max_new_tokens, ""
    t, layer = (int(x) for x in near.nonzero()[0])
    steps = max(0, min(g.max_new_tokens, t - len(g.prompt_ids[prompt]) + 1))
    return steps, (f"prompt {prompt}: routing of position {t} in layer {layer} is a near tie (router-logit gap "
                   f"{float(gaps[t, layer]):.3g} <= bound {float(golden_bound(var[t, layer], tp)):.3g}): "
                   f"{steps} of {g.max_new_tokens} steps compared")


def compare_with_golden(outputs: list[Generation], truth: GoldenTruth, tp: int, what: str,
                        prompts: tuple[str, ...] = PROMPTS) -> GoldenResult:
    """Raise AssertionError (message starting with ``what``) where ``outputs`` are not the reference's
    golden outputs of ``truth`` within the derived bounds; return what was compared."""
    g, result = truth.golden, GoldenResult()
    assert len(outputs) == len(g.prompt_ids), f"{what}: {len(outputs)} outputs for {len(g.prompt_ids)} prompts"
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        where = f"{what}: prompt {prompt!r}"
        if out.prompt_tokens is not None and out.prompt_tokens != len(g.prompt_ids[i]):
            raise AssertionError(f"{where}: the server counted {out.prompt_tokens} prompt tokens, the reference's "
                                 f"tokenizer gives {len(g.prompt_ids[i])} ({g.prompt_ids[i]}): is it serving with "
                                 f"the same tokenizer (--tokenizer)?")
        assert out.logprobs is not None, f"{where}: no logprobs returned"
        assert len(out.ids) >= g.max_new_tokens, (
            f"{where}: {len(out.ids)} tokens, expected {g.max_new_tokens} (finish_reason {out.finish_reason})")
        steps, note = comparable_steps(g, i, tp)
        if note:
            result.notes.append(note)
        for j in range(steps):
            token, ref = out.ids[j], int(g.output_ids[i, j])
            lp, ref_lp = out.logprobs[j], float(g.logprobs[i, j])
            bound = float(golden_bound(g.logprob_var[i, j], tp))
            if token != ref:
                gap, gap_var = truth.gap(i, j, token)
                gap_bound = float(golden_bound(gap_var, tp))
                if not gap <= gap_bound:
                    raise AssertionError(
                        f"{where}, step {j}: token id {token} where the reference's golden output {truth.label} has "
                        f"{ref} (golden ids {g.output_ids[i].tolist()}, got {list(out.ids[:g.max_new_tokens])}); "
                        f"their reference logit gap {gap:.4g} exceeds its bound {gap_bound:.4g}: not a "
                        f"legitimate divergence")
                bound, ref_lp = bound + gap_bound, ref_lp - gap
                result.notes.append(f"prompt {i}: legitimate divergence at step {j} (gap {gap:.3g} <= {gap_bound:.3g})")
            diff = abs(lp - ref_lp)
            if not diff <= bound:  # also catches NaN
                raise AssertionError(
                    f"{where}, step {j} (id {token}): logprob {lp:.6f} vs the reference's golden {ref_lp:.6f} "
                    f"({truth.label}): |diff| {diff:.3e} > bound {bound:.3e} (conformance/server/bounds.golden_bound)")
            result.compared += 1
            result.worst_ratio = max(result.worst_ratio, diff / bound if bound > 0 else math.inf)
            if token != ref:
                break
    return result


def label_of(path: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(path).name) or "checkpoint"
