"""What every server scenario works with: the :class:`ScenarioContext` (client, model, golden truths, deadline),
the sampling specs, and the steps the scenarios share: serve weight set ``a`` and check it (:func:`serve_a`),
greedy generation, bit-for-bit or tolerance comparison, the golden comparisons, and the server's calibration.
The scenarios themselves: :mod:`.scenarios_reload` and :mod:`.scenarios_consistency`; their list:
:mod:`.scenarios`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from conformance.server.bounds import RELOAD_LOGPROB_TOL
from conformance.interfaces.server_pace import Calibration, Pace
from conformance.interfaces.server_types import Deadline, Generation
from conformance.server.dialects import ServerDialect, SamplingSpec
from conformance.server.golden import GREEDY, PROMPTS, GoldenResult, GoldenTruth, compare_sampled_with_reference, compare_with_golden
from conformance.server.models import ServedModel


GREEDY_SPEC = SamplingSpec(GREEDY["max_new_tokens"], GREEDY["temperature"], ignore_eos=GREEDY["ignore_eos"])
SEEDED_SPEC = SamplingSpec(8, temperature=0.8, top_p=0.95, seed=1234)
RELOAD = ("reload_weights",)
RELEASE_RESUME = ("reload_weights", "release_memory", "resume_memory")


@dataclass
class ScenarioContext:
    client: ServerDialect
    model: ServedModel
    deadline: Deadline | None  # the user's ceiling for the whole scenario (--server-timeout); None: paced only
    truths: dict[str, GoldenTruth]  # golden outputs of weight sets "a" and "b"
    baseline: ServerDialect | None = None  # a TP1 server of the same engine (tp_agreement only)
    tp: int = 1
    fresh: list[Generation] | None = None  # greedy outputs right after start-up, before any reload
    name: str = "scenario"
    golden: GoldenResult = field(default_factory=GoldenResult)
    batch_invariant: bool = False  # the server promises batch invariance (--server-batch-invariant)

    @property
    def notes(self) -> list[str]:
        """What the scenario observed (reported with its result, not judged)."""
        return self.golden.observations

    def wait(self, future):
        """A future's result: bounded by the scenario's ceiling when there is one, else by the server's pace
        (every request the future makes is paced)."""
        return future.result(timeout=self.deadline.remaining() if self.deadline else None)


def must_reload(ctx: ScenarioContext, path: str, flush_cache: bool = True, client: ServerDialect | None = None) -> None:
    result = (client or ctx.client).reload_weights(path, flush_cache=flush_cache)
    assert result.success, f"reload_weights({path!r}) failed: {result.message}"


def can_reload(client: ServerDialect) -> bool:
    return not client.missing(RELOAD)


def check_golden(ctx: ScenarioContext, outputs: list[Generation], weight_set: str, what: str, tp: int | None = None) -> None:
    """``outputs`` (greedy, for PROMPTS) are the reference's golden outputs of ``weight_set``."""
    ctx.golden.add(compare_with_golden(outputs, ctx.truths[weight_set], ctx.tp if tp is None else tp,
                                       f"{what} vs the reference's golden outputs of weight set {weight_set!r}"))


def check_sampled(ctx: ScenarioContext, outputs: list[Generation], weight_set: str, what: str) -> None:
    """``outputs`` (SEEDED_SPEC sampling, for PROMPTS) carry the reference's logprobs of the tokens they sampled."""
    ctx.golden.add(compare_sampled_with_reference(
        outputs, ctx.truths[weight_set], ctx.tp, SEEDED_SPEC.temperature,
        f"{what} vs the reference's logprobs of the sampled tokens under weight set {weight_set!r}"))


def serve_a(ctx: ScenarioContext) -> list[Generation]:
    """Serve weight set ``a`` (reloading it) and return the greedy baseline for PROMPTS. Reloading the
    checkpoint the server started with must reproduce the fresh start-up outputs (token ids identical,
    logprobs within the reload tolerance): a reload path that drops or mangles a tensor shows here. Both
    must be the reference's golden outputs of ``a``. Through an API without a reload endpoint the server
    must still serve its start-up weights: the outputs are compared with the fresh ones the same way."""
    if can_reload(ctx.client):
        must_reload(ctx, ctx.model.a)
        how = "reloaded"
    else:
        how = f"start-up weights (the {ctx.client.name} API cannot reload: not reloaded)"
    out = greedy(ctx.client)
    if ctx.fresh is not None:
        assert_same(ctx.fresh, out, f"{ctx.name}: {how} {ctx.model.name} a vs the fresh start-up", RELOAD_LOGPROB_TOL)
        check_golden(ctx, ctx.fresh, "a", f"{ctx.name}: the fresh start-up")
    check_golden(ctx, out, "a", f"{ctx.name}: after reloading a" if how == "reloaded" else f"{ctx.name}: {how}")
    return out


def fresh_outputs(client: ServerDialect) -> list[Generation]:
    """Greedy outputs of a server that has just started (weights loaded by start-up, not by a reload)."""
    return greedy(client)


#: an attached server's start-up is not seen: its reloads and memory commands are paced as if it had taken
#: this long to start (loading a large checkpoint from disk), before any probing
ATTACHED_STARTUP_S = 120.0


def calibrate(client: ServerDialect, startup_s: float | None) -> Pace:
    """The server's pace (conformance/interfaces/server_pace.py), measured once it has served its first
    requests: one greedy batch of PROMPTS (the scenarios' largest but for one 2x batch) and one 1-token request,
    each timed; ``startup_s`` (launch to healthy; None for an attached server) bounds control operations."""
    start = time.monotonic()
    greedy(client)
    generate_s = time.monotonic() - start
    start = time.monotonic()
    client.generate([PROMPTS[0]], SamplingSpec(1))
    probe_s = time.monotonic() - start
    return Pace(Calibration(generate_s, probe_s, ATTACHED_STARTUP_S if startup_s is None else startup_s, PROMPTS[0]))


def greedy(client: ServerDialect, prompts=PROMPTS) -> list[Generation]:
    return client.generate(list(prompts), GREEDY_SPEC)


def assert_same(before: list[Generation], after: list[Generation], what: str, logprob_tol: float | None) -> None:
    """Text and token ids identical; logprobs equal (``logprob_tol`` None) or within ``logprob_tol``."""
    assert len(before) == len(after), f"{what}: {len(after)} outputs for {len(before)} prompts"
    for prompt, b, a in zip(PROMPTS, before, after):
        assert a.ids == b.ids, f"{what}: prompt {prompt!r}: token ids {list(a.ids)} != before {list(b.ids)}"
        assert a.text == b.text, f"{what}: prompt {prompt!r}: text {a.text!r} != before {b.text!r}"
        assert a.logprobs is not None and b.logprobs is not None, f"{what}: logprobs missing"
        for j, (lb, la) in enumerate(zip(b.logprobs, a.logprobs)):
            ok = la == lb if logprob_tol is None else abs(la - lb) <= logprob_tol
            assert ok, (f"{what}: prompt {prompt!r}, token {j} (id {a.ids[j]}): logprob {la!r} vs before {lb!r} "
                        f"({'must be identical' if logprob_tol is None else f'tolerance {logprob_tol}'})")


def differs(x: list[Generation], y: list[Generation]) -> bool:
    return any(a.ids != b.ids or a.logprobs != b.logprobs for a, b in zip(x, y))

