"""The server scenarios, as data: each is a named function of a :class:`ScenarioContext` that raises
AssertionError (naming the scenario, the prompt and the token) when the server misbehaves.

Every scenario starts from weight set ``a`` (it reloads it first; through an API without a reload endpoint
it checks that the start-up weights still serve) and leaves ``a`` serving. Scenarios talk to the server
only through a :class:`~.dialects.ServerDialect` (``--server-api``); one that needs an operation the API
lacks (``Scenario.needs``) is skipped with the API's reason before it sends anything. Two kinds of
check: *self-consistency* (a reload of the same weights, a repeated request, TPn vs TP1 of the same engine:
identical or within the engine's own tolerance) and *truth*: every greedy generation is compared with the
reference model's golden outputs of the weight set that should be serving (conformance/server/golden.py),
within bounds derived from BF16 arithmetic (conformance/server/bounds.golden_bound).
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import pytest

from conformance.server.bounds import RELOAD_LOGPROB_TOL, tp_logprob_bound
from conformance.interfaces.server_pace import Calibration, Pace
from conformance.interfaces.server_types import Deadline, Generation
from conformance.server.bf16_copies import copy_tensor_name, verify_corrupt_copy
from conformance.server.corruptions import CORRUPTIONS, CORRUPTIONS_BY_ID, corrupt_checkpoint, verify
from conformance.server.derive import verify_corrupt
from conformance.server.dialects import ServerDialect, SamplingSpec
from conformance.server.golden import GREEDY, PROMPTS, GoldenResult, GoldenTruth, compare_sampled_with_reference, compare_with_golden
from conformance.server.models import ServedModel, work_dir


GREEDY_SPEC = SamplingSpec(GREEDY["max_new_tokens"], GREEDY["temperature"], ignore_eos=GREEDY["ignore_eos"])
SEEDED_SPEC = SamplingSpec(8, temperature=0.8, top_p=0.95, seed=1234)
RELOAD = ("reload_weights",)
RESTORE_TIMEOUT_S = 20.0  # after a failed scenario: bring the server back to serving, whatever the deadline left
RELEASE_RESUME = ("reload_weights", "release_memory", "resume_memory")
CONCURRENT_ROUNDS = 5  # batch_size_invariance: concurrent rounds for a server that promises invariance (see there)


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


# ----------------------------------------------------------------------------------------- helpers
def _reload(ctx: ScenarioContext, path: str, flush_cache: bool = True, client: ServerDialect | None = None) -> None:
    result = (client or ctx.client).reload_weights(path, flush_cache=flush_cache)
    assert result.success, f"reload_weights({path!r}) failed: {result.message}"


def _can_reload(client: ServerDialect) -> bool:
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


def _start(ctx: ScenarioContext) -> list[Generation]:
    """Serve weight set ``a`` (reloading it) and return the greedy baseline for PROMPTS. Reloading the
    checkpoint the server started with must reproduce the fresh start-up outputs (token ids identical,
    logprobs within the reload tolerance): a reload path that drops or mangles a tensor shows here. Both
    must be the reference's golden outputs of ``a``. Through an API without a reload endpoint the server
    must still serve its start-up weights: the outputs are compared with the fresh ones the same way."""
    if _can_reload(ctx.client):
        _reload(ctx, ctx.model.a)
        how = "reloaded"
    else:
        how = f"start-up weights (the {ctx.client.name} API cannot reload: not reloaded)"
    out = _greedy(ctx.client)
    if ctx.fresh is not None:
        _assert_same(ctx.fresh, out, f"{ctx.name}: {how} {ctx.model.name} a vs the fresh start-up", RELOAD_LOGPROB_TOL)
        check_golden(ctx, ctx.fresh, "a", f"{ctx.name}: the fresh start-up")
    check_golden(ctx, out, "a", f"{ctx.name}: after reloading a" if how == "reloaded" else f"{ctx.name}: {how}")
    return out


def fresh_outputs(client: ServerDialect) -> list[Generation]:
    """Greedy outputs of a server that has just started (weights loaded by start-up, not by a reload)."""
    return _greedy(client)


#: an attached server's start-up is not seen: its reloads and memory commands are paced as if it had taken
#: this long to start (loading a large checkpoint from disk), before any probing
ATTACHED_STARTUP_S = 120.0


def calibrate(client: ServerDialect, startup_s: float | None) -> Pace:
    """The server's pace (conformance/interfaces/server_pace.py), measured once it has served its first
    requests: one greedy batch of PROMPTS (the scenarios' largest but for one 2x batch) and one 1-token request,
    each timed; ``startup_s`` (launch to healthy; None for an attached server) bounds control operations."""
    start = time.monotonic()
    _greedy(client)
    generate_s = time.monotonic() - start
    start = time.monotonic()
    client.generate([PROMPTS[0]], SamplingSpec(1))
    probe_s = time.monotonic() - start
    return Pace(Calibration(generate_s, probe_s, ATTACHED_STARTUP_S if startup_s is None else startup_s, PROMPTS[0]))


def _greedy(client: ServerDialect, prompts=PROMPTS) -> list[Generation]:
    return client.generate(list(prompts), GREEDY_SPEC)


def _assert_same(before: list[Generation], after: list[Generation], what: str, logprob_tol: float | None) -> None:
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


def _differs(x: list[Generation], y: list[Generation]) -> bool:
    return any(a.ids != b.ids or a.logprobs != b.logprobs for a, b in zip(x, y))


# ----------------------------------------------------------------------------------------- scenarios
def reload_same_checkpoint(ctx: ScenarioContext) -> None:
    """The engine's own test: release memory, resume weights, reload the same checkpoint (with and then
    without flush_cache), resume kv_cache and cuda_graph; outputs identical, logprobs within 1e-4."""
    before = _start(ctx)
    for flush in (True, False):
        ctx.client.release_memory()
        ctx.client.resume_memory(["weights"])
        _reload(ctx, ctx.model.a, flush_cache=flush)
        ctx.client.resume_memory(["kv_cache", "cuda_graph"])
        after = _greedy(ctx.client)
        _assert_same(before, after, f"reload_same_checkpoint (flush_cache={flush})", RELOAD_LOGPROB_TOL)
        check_golden(ctx, after, "a", f"reload_same_checkpoint (flush_cache={flush})")


def reload_different_weights(ctx: ScenarioContext) -> None:
    """Reloading other weights must give the golden outputs of those weights (not merely different ones), for
    greedy and for sampled requests; reloading the originals restores them bit for bit."""
    before = _start(ctx)
    _reload(ctx, ctx.model.b)
    other = _greedy(ctx.client)
    assert _differs(before, other), (
        "reload_different_weights: outputs after loading different weights are identical to before; "
        "the reload did not take effect")
    check_golden(ctx, other, "b", "reload_different_weights: after reloading b")
    check_sampled(ctx, ctx.client.generate(list(PROMPTS), SEEDED_SPEC), "b", "reload_different_weights: seeded sampling after reloading b")
    _reload(ctx, ctx.model.a)
    restored = _greedy(ctx.client)
    _assert_same(before, restored, "reload_different_weights (originals restored)", None)
    check_golden(ctx, restored, "a", "reload_different_weights: after reloading a again")


def _failed_reload(ctx: ScenarioContext, path: str, what: str) -> None:
    before = _start(ctx)
    result = ctx.client.reload_weights(path)
    assert not result.success, f"{what}: reload_weights({path!r}) reported success"
    assert result.message.strip(), f"{what}: a failed reload must say why (empty message)"
    after = _greedy(ctx.client)
    _assert_same(before, after, f"{what} (old weights must keep serving)", None)
    check_golden(ctx, after, "a", f"{what} (old weights must keep serving)")


def failed_reload_missing_path(ctx: ScenarioContext) -> None:
    """A path that does not exist: success false with a message, the old weights keep serving."""
    missing = ctx.model.a.rstrip("/") + "-does-not-exist"
    if os.path.exists(missing):
        pytest.skip(f"failed_reload_missing_path: {missing!r} exists, cannot test a missing path there")
    _failed_reload(ctx, missing, "failed_reload_missing_path")


def failed_reload_corrupt_checkpoint(ctx: ScenarioContext) -> None:
    """Different weights with one tensor of the last layer missing: a loader that copies tensor by tensor
    before validating would leave half-loaded weights; the old weights must keep serving unchanged. The
    corrupt checkpoint is first verified to be exactly ``b`` minus that tensor (else this would test nothing;
    with BF16 copies, both the original and the copy)."""
    original = ctx.model.truth_model
    try:
        verify_corrupt(original.b, original.corrupt, original.corrupt_tensor)
        if ctx.model.original is not None:  # BF16 copies: the copy of corrupt is the copy of b minus that linear
            verify_corrupt_copy(ctx.model.b, ctx.model.corrupt, ctx.model.corrupt_tensor)
    except AssertionError as exc:
        raise AssertionError(f"failed_reload_corrupt_checkpoint: the corrupt checkpoint is not broken as intended, "
                             f"so the scenario would test nothing: {exc}") from exc
    _failed_reload(ctx, ctx.model.corrupt, "failed_reload_corrupt_checkpoint")


def _failed_reload_damaged(corruption_id: str) -> Callable[[ScenarioContext], None]:
    """The failed-reload scenario of one class of damage (conformance/server/corruptions.py)."""
    corruption = CORRUPTIONS_BY_ID[corruption_id]
    name = f"failed_reload_{corruption_id}"

    def scenario(ctx: ScenarioContext) -> None:
        bf16 = ctx.model.original is not None
        reason = corruption.exists_for("bf16" if bf16 else "nvfp4")
        if reason:
            pytest.skip(f"{name}: skipped for BF16 copies: {reason}")
        tensor = copy_tensor_name(ctx.model.truth_model.corrupt_tensor) if bf16 else ctx.model.corrupt_tensor
        work = work_dir() / f"damaged-{ctx.model.name}-{'bf16' if bf16 else 'nvfp4'}"
        path, tensor = corrupt_checkpoint(corruption, ctx.model.b, work, tensor, bf16)
        try:
            verify(corruption, ctx.model.b, path, tensor, bf16)
        except AssertionError as exc:
            raise AssertionError(f"{name}: the damaged checkpoint is not damaged as intended, so the scenario would "
                                 f"test nothing: {exc}") from exc
        _failed_reload(ctx, path, name)

    scenario.__name__ = name
    scenario.__doc__ = (f"Weight set b with {corruption.what} ({corruption_id}; verified first): the reload must "
                        f"fail with a message and the old weights keep serving bit for bit.")
    return scenario


def generate_during_reload(ctx: ScenarioContext) -> None:
    """Generate requests sent before, during and after a reload all complete, each the golden output of the
    old or of the new weights (never a mix); requests sent after the reload answered have the new weights'
    golden output. (Whether outputs of the same weights are identical across the batches they happened to
    share is batch invariance, which not every engine promises: batch_size_invariance checks it.)"""
    _start(ctx)
    singles = [(i, p) for i, p in enumerate(PROMPTS)] * 2

    def one(item):
        i, prompt = item
        return i, ctx.client.generate([prompt], GREEDY_SPEC)[0]

    with ThreadPoolExecutor(max_workers=8) as pool:
        early = [pool.submit(one, it) for it in singles]
        time.sleep(0.02)
        reload = pool.submit(ctx.client.reload_weights, ctx.model.b)
        time.sleep(0.05)
        during = [pool.submit(one, it) for it in singles]
        result = ctx.wait(reload)
        assert result.success, f"generate_during_reload: the reload failed: {result.message}"
        late = [pool.submit(one, it) for it in singles[: len(PROMPTS)]]
        results = []
        for wave, futures in (("before", early), ("during", during), ("after", late)):
            for n, f in enumerate(futures):
                i, g = ctx.wait(f)
                results.append((wave, n, i, g))
    for wave, n, i, g in results:
        tag = f"generate_during_reload: request {n} sent {wave} the reload (prompt {PROMPTS[i]!r})"
        assert len(g.ids) == GREEDY_SPEC.max_new_tokens, (
            f"{tag} was lost or cut short: {len(g.ids)} tokens, finish_reason {g.finish_reason}")
        candidates = ([("old", "a")] if wave != "after" else []) + [("new", "b")]
        failures, match = [], None
        for name, weight_set in candidates:
            try:
                result = compare_with_golden([g], _one_prompt(ctx.truths[weight_set], i), ctx.tp, f"{tag}",
                                             (PROMPTS[i],))
            except AssertionError as exc:
                failures.append(f"not the {name} weights' ({weight_set}): {exc}")
                continue
            match = name
            ctx.golden.add(result)
            break
        assert match, f"{tag}: output {list(g.ids)} is neither weight set's golden output: " + "; ".join(failures)
    _reload(ctx, ctx.model.a)


def _one_prompt(truth: GoldenTruth, i: int) -> GoldenTruth:
    """The golden truth restricted to prompt ``i`` (same checkpoint, same on-demand model)."""
    from reference_impl.golden import GoldenSet

    g = truth.golden
    sub = GoldenSet(g.checkpoint_digest, [g.prompt_ids[i]], *(t[i:i + 1] for t in (
        g.output_ids, g.logprobs, g.logprob_var, g.top_ids, g.top_gaps, g.route_gaps, g.route_var)))
    return GoldenTruth(truth.label, truth.path, sub, truth._exact, device=truth.device)


def repeated_requests_deterministic(ctx: ScenarioContext) -> None:
    """The same greedy request repeated gives identical tokens and logprobs; the same seeded sampling
    request gives identical tokens, whose logprobs are the reference's for those tokens."""
    first = _start(ctx)
    for k in range(3):
        _assert_same(first, _greedy(ctx.client), f"repeated_requests_deterministic (repeat {k + 1})", None)
    s1 = ctx.client.generate(list(PROMPTS), SEEDED_SPEC)
    s2 = ctx.client.generate(list(PROMPTS), SEEDED_SPEC)
    for prompt, a, b in zip(PROMPTS, s1, s2):
        assert a.ids == b.ids, f"repeated_requests_deterministic: seeded sampling of {prompt!r}: {list(a.ids)} != {list(b.ids)}"
    check_sampled(ctx, s1, "a", "repeated_requests_deterministic: seeded sampling")


def batch_size_invariance(ctx: ScenarioContext) -> None:
    """A prompt's tokens and logprobs do not depend on what it is batched with. Not every engine promises this
    (marker batch_invariance: deselect it with ``-m "not batch_invariance"``).

    What is compared is chosen here, not by the server's scheduler, so the verdict is the same on every run:
    each prompt alone vs *explicit* batches (one request carrying several prompts: in order, reversed, and every
    prompt twice), bit for bit. Concurrent single-prompt requests are then sent together; whether the server
    co-batched them depends on its scheduler and timing, so it is observed (the server's running-request
    gauge, where it has one) and reported, not relied on. A server that promises batch invariance
    (``--server-batch-invariant``; the reference server does) must give the alone outputs bit for bit there
    too; any other server's concurrent outputs are judged against the truth like every generation."""
    in_order = _start(ctx)
    alone = [ctx.client.generate([p], GREEDY_SPEC)[0] for p in PROMPTS]
    _assert_same(alone, in_order, "batch_size_invariance (alone vs one batched request)", None)
    reverse = ctx.client.generate(list(PROMPTS[::-1]), GREEDY_SPEC)[::-1]
    _assert_same(alone, reverse, "batch_size_invariance (alone vs one batched request, prompts reversed)", None)
    twice = ctx.client.generate(list(PROMPTS) * 2, GREEDY_SPEC)
    _assert_same(alone, twice[: len(PROMPTS)], "batch_size_invariance (alone vs one batch of every prompt twice)", None)
    _assert_same(alone, twice[len(PROMPTS):], "batch_size_invariance (alone vs one batch of every prompt twice, "
                                              "2nd copy)", None)
    # A server that promises invariance gets up to CONCURRENT_ROUNDS rounds, until its gauge shows that it
    # co-batched (all of them where it has no gauge): the comparison then covers co-batched forwards on every run
    # where the scheduler co-batches at all, not only when it happened to in one round
    for round_ in range(CONCURRENT_ROUNDS if ctx.batch_invariant else 1):
        with RunningGauge(ctx.client) as gauge, ThreadPoolExecutor(max_workers=2 * len(PROMPTS)) as pool:
            futures = [pool.submit(ctx.client.generate, [p], GREEDY_SPEC) for p in PROMPTS * 2]
            concurrent = [f.result()[0] for f in futures]  # each request is bounded by the server's pace
        seen = gauge.describe()
        ctx.notes.append(f"batch_size_invariance: round {round_ + 1}, {2 * len(PROMPTS)} concurrent requests: {seen}")
        for k, half in enumerate((concurrent[: len(PROMPTS)], concurrent[len(PROMPTS):])):
            what = f"concurrent{', 2nd copy' if k else ''}, round {round_ + 1}"
            if ctx.batch_invariant:
                _assert_same(alone, half, f"batch_size_invariance (alone vs {what}; the server promises batch "
                                          f"invariance; {seen})", None)
            else:
                check_golden(ctx, half, "a", f"batch_size_invariance: {what} ({seen}; bit-for-bit agreement with "
                                             f"alone not asked: the server does not promise batch invariance, "
                                             f"--server-batch-invariant)")
        if gauge.cobatched:
            break


class RunningGauge:
    """Polls the server's running-request gauge (``ServerDialect.running_requests``) while concurrent requests
    are in flight: the largest value seen says whether the server co-batched them. Only reported."""

    POLL_S = 0.05

    def __init__(self, client: ServerDialect):
        self.client = type(client)(client.base_url, None, 2.0)  # not paced: the gauge is read at once
        self.peak: int | None = None
        self.available = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="running-gauge", daemon=True)

    def __enter__(self) -> "RunningGauge":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.client.close()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                n = self.client.running_requests()
            except AssertionError:
                n = None
            if n is None:
                self.available = False
                return
            self.peak = n if self.peak is None else max(self.peak, n)
            self._stop.wait(self.POLL_S)

    @property
    def cobatched(self) -> bool | None:
        """Whether the server ran two or more of the requests at once (None: it has no gauge to tell)."""
        return None if not self.available or self.peak is None else self.peak > 1

    def describe(self) -> str:
        if not self.available or self.peak is None:
            return f"whether the server co-batched them is unknown (the {self.client.name} API reports no running-request gauge)"
        if self.peak > 1:
            return f"the server co-batched them (up to {self.peak} requests running at once)"
        return "the server ran them one at a time (its running-request gauge never exceeded 1)"


def tp_agreement(ctx: ScenarioContext) -> None:
    """TPn agrees with TP1 of the same engine within the derived bound (see bounds.tp_logprob_bound),
    at every position up to and including the first greedy divergence. Both serve ``a`` (reloaded, or
    through an API without a reload endpoint from start-up; both must be its golden outputs either way)."""
    assert ctx.baseline is not None, "tp_agreement needs a TP1 baseline server"
    if _can_reload(ctx.client):
        _reload(ctx, ctx.model.a)
        _reload(ctx, ctx.model.a, client=ctx.baseline)
    mine, base = _greedy(ctx.client), _greedy(ctx.baseline)
    check_golden(ctx, mine, "a", f"tp_agreement: TP{ctx.tp}")
    check_golden(ctx, base, "a", "tp_agreement: the TP1 baseline", tp=1)
    truth = ctx.model.truth_model
    layers, max_logit = reference_logit_scale(truth.a, truth.tokenizer, [list(PROMPTS)])
    bound = tp_logprob_bound(layers, ctx.tp, max_logit)
    for prompt, m, b in zip(PROMPTS, mine, base):
        for j, (lm, lb) in enumerate(zip(m.logprobs, b.logprobs)):
            assert abs(lm - lb) <= bound, (
                f"tp_agreement: prompt {prompt!r}, token {j}: TP{ctx.tp} logprob {lm:.6f} (id {m.ids[j]}) vs TP1 "
                f"{lb:.6f} (id {b.ids[j]}) differ by {abs(lm - lb):.3e} > bound {bound:.3e}")
            if m.ids[j] != b.ids[j]:
                break


def reference_logit_scale(model_path: str, tokenizer_json: str, prompt_sets: list[list[str]]) -> tuple[int, float]:
    """(num_layers, max |logit|) of the model on the prompts, from the reference model."""
    import torch
    from tokenizers import Tokenizer

    from reference_impl.checkpoint import load_checkpoint
    from reference_impl.model import TinyModel, shard_weights, validate_checkpoint

    ckpt = load_checkpoint(model_path)
    cfg = validate_checkpoint(ckpt)
    tok = Tokenizer.from_file(tokenizer_json)
    model = TinyModel(cfg, shard_weights(cfg, ckpt.tensors))
    seqs = [torch.tensor(tok.encode(p).ids) for ps in prompt_sets for p in ps]
    return cfg.num_layers, float(model.logits(seqs).abs().max())


# ----------------------------------------------------------------------------------------- the list
@dataclass(frozen=True)
class Scenario:
    id: str
    run: Callable[[ScenarioContext], None]
    timeout_s: float = 120.0
    marks: tuple[str, ...] = ()
    needs_tp_baseline: bool = False
    needs: tuple[str, ...] = ()  # dialect operations (ServerDialect.unsupported keys) it cannot run without

    def skip_reason(self, dialect: ServerDialect | type[ServerDialect]) -> str | None:
        """Why this scenario cannot run through ``dialect`` (None: it can)."""
        missing = dialect.missing(self.needs)
        if not missing:
            return None
        by_reason: dict[str, list[str]] = {}
        for op, why in missing.items():
            by_reason.setdefault(why, []).append(op)
        return f"{self.id}: skipped: the {dialect.name} API cannot " + "; ".join(
            f"{', '.join(ops)} ({why})" for why, ops in by_reason.items())


SCENARIOS = (
    Scenario("reload_same_checkpoint", reload_same_checkpoint, needs=RELEASE_RESUME),
    Scenario("reload_different_weights", reload_different_weights, needs=RELOAD),
    Scenario("failed_reload_missing_path", failed_reload_missing_path, needs=RELOAD),
    Scenario("failed_reload_corrupt_checkpoint", failed_reload_corrupt_checkpoint, needs=RELOAD),
    *(Scenario(f"failed_reload_{c.id}", _failed_reload_damaged(c.id), needs=RELOAD)
      for c in CORRUPTIONS if c.id != "corrupt_checkpoint"),
    Scenario("generate_during_reload", generate_during_reload, needs=RELOAD),
    Scenario("repeated_requests_deterministic", repeated_requests_deterministic),
    Scenario("batch_size_invariance", batch_size_invariance, marks=("batch_invariance",)),
    Scenario("tp_agreement", tp_agreement, needs_tp_baseline=True),
)
SCENARIOS_BY_ID = {s.id: s for s in SCENARIOS}


def workload_scenario(workload, device: str | None, report_dir=None) -> Scenario:
    """The scenario of ``--workload``: ``workload`` sent and judged position by position
    (conformance/server/workload_scenario.py)."""
    def run(ctx: ScenarioContext) -> None:
        from conformance.server.workload_scenario import run_workload

        _start(ctx)  # weight set a serving (reloaded where the API can), as every scenario starts
        coverage = run_workload(ctx, workload, device, report_dir)
        ctx.golden.compared += coverage.judged
        ctx.golden.worst_ratio = max([ctx.golden.worst_ratio] + [c.worst_ratio for c in coverage.cells.values()])
        ctx.golden.observations += coverage.notes + [f"workload {workload.name}: {coverage.judged} positions judged "
                                                     f"in {len(coverage.cells)} (phase, bucket) cells"]

    return Scenario(f"workload_{workload.name}", run, marks=("workload",))


def run_scenario(scenario: Scenario, client: ServerDialect, model: ServedModel, truths: dict[str, GoldenTruth],
                 baseline: ServerDialect | None = None, tp: int = 1, timeout_s: float | None = None,
                 fresh: list[Generation] | None = None, batch_invariant: bool = False) -> GoldenResult:
    """Run one scenario; returns what its golden comparisons covered. A scenario needing an operation the
    dialect lacks is skipped with the dialect's reason before any request; one that could compare no token
    with the golden outputs (every prompt stopped by a routing near-tie) is skipped, with the reason.

    Time: a client with a pace (the pool calibrates every server it starts or attaches to) bounds each request
    from the server's own speed and tells a slow server from a lost request; the whole scenario then has no
    fixed limit unless ``timeout_s`` (``--server-timeout``) sets one. A client without a pace falls back to the
    scenario's fixed ``timeout_s``."""
    reason = scenario.skip_reason(client)
    if reason:
        pytest.skip(reason)
    paced = client.pace is not None
    deadline = (Deadline(timeout_s, f"scenario {scenario.id} (--server-timeout)") if timeout_s
                else None if paced else Deadline(scenario.timeout_s, f"scenario {scenario.id}"))
    ctx = ScenarioContext(client.with_deadline(deadline), model, deadline, truths,
                          baseline.with_deadline(deadline) if baseline else None, tp, fresh, scenario.id,
                          batch_invariant=batch_invariant)
    try:
        scenario.run(ctx)
    except Exception:
        recovery = client.with_deadline(Deadline(RESTORE_TIMEOUT_S * (client.pace.slowest if paced else 1.0),
                                                 f"restoring the server after {scenario.id}"))
        recovery.restore_serving()
        recovery.close()
        raise
    finally:
        ctx.client.close()
        if ctx.baseline:
            ctx.baseline.close()
    if ctx.golden.compared == 0:
        pytest.skip(f"{scenario.id}: its checks passed but no token could be compared with the reference's golden "
                    f"outputs: {'; '.join(dict.fromkeys(ctx.golden.notes)) or 'nothing compared'}")
    return ctx.golden
