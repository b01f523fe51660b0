"""The consistency scenarios: repeated requests deterministic, a prompt's output independent of its batch, and
TPn agreeing with TP1 of the same engine. Listed in :data:`conformance.server.scenarios.SCENARIOS`.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from conformance.server.bounds import tp_logprob_bound
from conformance.server.dialects import ServerDialect
from conformance.server.golden import PROMPTS
from conformance.server.scenario_context import (GREEDY_SPEC, SEEDED_SPEC, ScenarioContext, assert_same, can_reload,
                                                 check_golden, check_sampled, greedy, must_reload, serve_a)

CONCURRENT_ROUNDS = 5  # batch_size_invariance: concurrent rounds for a server that promises invariance (see there)


def repeated_requests_deterministic(ctx: ScenarioContext) -> None:
    """The same greedy request repeated gives identical tokens and logprobs; the same seeded sampling
    request gives identical tokens, whose logprobs are the reference's for those tokens."""
    first = serve_a(ctx)
    for k in range(3):
        assert_same(first, greedy(ctx.client), f"repeated_requests_deterministic (repeat {k + 1})", None)
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
    in_order = serve_a(ctx)
    alone = [ctx.client.generate([p], GREEDY_SPEC)[0] for p in PROMPTS]
    assert_same(alone, in_order, "batch_size_invariance (alone vs one batched request)", None)
    reverse = ctx.client.generate(list(PROMPTS[::-1]), GREEDY_SPEC)[::-1]
    assert_same(alone, reverse, "batch_size_invariance (alone vs one batched request, prompts reversed)", None)
    twice = ctx.client.generate(list(PROMPTS) * 2, GREEDY_SPEC)
    assert_same(alone, twice[: len(PROMPTS)], "batch_size_invariance (alone vs one batch of every prompt twice)", None)
    assert_same(alone, twice[len(PROMPTS):], "batch_size_invariance (alone vs one batch of every prompt twice, "
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
                assert_same(alone, half, f"batch_size_invariance (alone vs {what}; the server promises batch "
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
    if can_reload(ctx.client):
        must_reload(ctx, ctx.model.a)
        must_reload(ctx, ctx.model.a, client=ctx.baseline)
    mine, base = greedy(ctx.client), greedy(ctx.baseline)
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

    from reference_impl.model.checkpoint import load_checkpoint
    from reference_impl.model import TinyModel, shard_weights, validate_checkpoint

    ckpt = load_checkpoint(model_path)
    cfg = validate_checkpoint(ckpt)
    tok = Tokenizer.from_file(tokenizer_json)
    model = TinyModel(cfg, shard_weights(cfg, ckpt.tensors))
    seqs = [torch.tensor(tok.encode(p).ids) for ps in prompt_sets for p in ps]
    return cfg.num_layers, float(model.logits(seqs).abs().max())

