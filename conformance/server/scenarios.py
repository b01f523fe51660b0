"""The server scenarios, as data: each is a named function of a :class:`ScenarioContext` that raises
AssertionError (naming the scenario, the prompt and the token) when the server misbehaves.

Every scenario starts from the fixture's weight set ``a`` (it reloads it first) and leaves ``a`` serving.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from .bounds import RELOAD_LOGPROB_TOL, tp_logprob_bound
from .client import Deadline, Generation, ServerClient
from .models import FixtureModel

PROMPTS = ("the city of water", "a new river and the old stone tree", "music of the sea and the moon",
           "people of the north")
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@dataclass
class ScenarioContext:
    client: ServerClient
    model: FixtureModel
    deadline: Deadline
    baseline: ServerClient | None = None  # a TP1 server of the same engine (tp_agreement only)
    tp: int = 1
    fresh: list[Generation] | None = None  # greedy outputs right after start-up, before any reload
    name: str = "scenario"


# ----------------------------------------------------------------------------------------- helpers
def _reload(ctx: ScenarioContext, path: str, flush_cache: bool = True) -> None:
    ok, message = ctx.client.update_weights_from_disk(path, flush_cache=flush_cache)
    assert ok, f"update_weights_from_disk({path!r}) failed: {message}"


def _start(ctx: ScenarioContext) -> list[Generation]:
    """Serve weight set ``a`` (reloading it) and return the greedy baseline for PROMPTS. Reloading the
    checkpoint the server started with must reproduce the fresh start-up outputs (token ids identical,
    logprobs within the reload tolerance): a reload path that drops or mangles a tensor shows here."""
    _reload(ctx, ctx.model.a)
    out = _greedy(ctx.client)
    if ctx.fresh is not None:
        _assert_same(ctx.fresh, out, f"{ctx.name}: reloaded {ctx.model.family}-a vs the fresh start-up", RELOAD_LOGPROB_TOL)
    return out


def fresh_outputs(client: ServerClient) -> list[Generation]:
    """Greedy outputs of a server that has just started (weights loaded by start-up, not by a reload)."""
    return _greedy(client)


def _greedy(client: ServerClient, prompts=PROMPTS) -> list[Generation]:
    return client.generate(list(prompts), GREEDY, return_logprob=True)


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
        ctx.client.release_memory_occupation()
        ctx.client.resume_memory_occupation(["weights"])
        _reload(ctx, ctx.model.a, flush_cache=flush)
        ctx.client.resume_memory_occupation(["kv_cache", "cuda_graph"])
        after = _greedy(ctx.client)
        _assert_same(before, after, f"reload_same_checkpoint (flush_cache={flush})", RELOAD_LOGPROB_TOL)


def reload_different_weights(ctx: ScenarioContext) -> None:
    """Reloading other weights must change the output; reloading the originals restores it bit for bit."""
    before = _start(ctx)
    _reload(ctx, ctx.model.b)
    other = _greedy(ctx.client)
    assert _differs(before, other), (
        "reload_different_weights: outputs after loading different weights are identical to before; "
        "the reload did not take effect")
    _reload(ctx, ctx.model.a)
    _assert_same(before, _greedy(ctx.client), "reload_different_weights (originals restored)", None)


def _failed_reload(ctx: ScenarioContext, path: str, what: str) -> None:
    before = _start(ctx)
    ok, message = ctx.client.update_weights_from_disk(path)
    assert not ok, f"{what}: update_weights_from_disk({path!r}) reported success"
    assert message.strip(), f"{what}: a failed reload must say why (empty message)"
    _assert_same(before, _greedy(ctx.client), f"{what} (old weights must keep serving)", None)


def failed_reload_missing_path(ctx: ScenarioContext) -> None:
    """A path that does not exist: success false with a message, the old weights keep serving."""
    _failed_reload(ctx, ctx.model.a + "-does-not-exist", "failed_reload_missing_path")


def failed_reload_corrupt_checkpoint(ctx: ScenarioContext) -> None:
    """Different weights with one tensor of the last layer missing: a loader that copies tensor by tensor
    before validating would leave half-loaded weights; the old weights must keep serving unchanged."""
    _failed_reload(ctx, ctx.model.corrupt, "failed_reload_corrupt_checkpoint")


def generate_during_reload(ctx: ScenarioContext) -> None:
    """Generate requests sent before, during and after a reload all complete, each consistent with the old
    or the new weights; requests sent after the reload answered see the new weights."""
    expected_a = _start(ctx)
    _reload(ctx, ctx.model.b)
    expected_b = _greedy(ctx.client)
    _reload(ctx, ctx.model.a)
    singles = [(i, p) for i, p in enumerate(PROMPTS)] * 2

    def one(item):
        i, prompt = item
        return i, ctx.client.generate([prompt], GREEDY)[0]

    with ThreadPoolExecutor(max_workers=8) as pool:
        early = [pool.submit(one, it) for it in singles]
        time.sleep(0.02)
        reload = pool.submit(ctx.client.update_weights_from_disk, ctx.model.b)
        time.sleep(0.05)
        during = [pool.submit(one, it) for it in singles]
        ok, message = reload.result(timeout=ctx.deadline.remaining())
        assert ok, f"generate_during_reload: the reload failed: {message}"
        late = [pool.submit(one, it) for it in singles[: len(PROMPTS)]]
        results = []
        for wave, futures in (("before", early), ("during", during), ("after", late)):
            for n, f in enumerate(futures):
                i, g = f.result(timeout=ctx.deadline.remaining())
                results.append((wave, n, i, g))
    for wave, n, i, g in results:
        tag = f"generate_during_reload: request {n} sent {wave} the reload (prompt {PROMPTS[i]!r})"
        assert len(g.ids) == GREEDY["max_new_tokens"], (
            f"{tag} was lost or cut short: {len(g.ids)} tokens, finish_reason {g.finish_reason}")
        candidates = [("old", expected_a[i])] if wave != "after" else []
        candidates.append(("new", expected_b[i]))
        matches = [name for name, e in candidates if e.ids == g.ids and all(
            abs(x - y) <= RELOAD_LOGPROB_TOL for x, y in zip(e.logprobs, g.logprobs))]
        assert matches, (f"{tag}: output {list(g.ids)} matches neither "
                         + " nor ".join(f"the {name} weights' {list(e.ids)}" for name, e in candidates))
    _reload(ctx, ctx.model.a)


def repeated_requests_deterministic(ctx: ScenarioContext) -> None:
    """The same greedy request repeated gives identical tokens and logprobs; the same seeded sampling
    request gives identical tokens."""
    first = _start(ctx)
    for k in range(3):
        _assert_same(first, _greedy(ctx.client), f"repeated_requests_deterministic (repeat {k + 1})", None)
    seeded = {"max_new_tokens": 8, "temperature": 0.8, "top_p": 0.95, "ignore_eos": True, "sampling_seed": 1234}
    s1 = ctx.client.generate(list(PROMPTS), seeded)
    s2 = ctx.client.generate(list(PROMPTS), seeded)
    for prompt, a, b in zip(PROMPTS, s1, s2):
        assert a.ids == b.ids, f"repeated_requests_deterministic: seeded sampling of {prompt!r}: {list(a.ids)} != {list(b.ids)}"


def batch_size_invariance(ctx: ScenarioContext) -> None:
    """A prompt's tokens and logprobs do not depend on what it is batched with: alone, in one batched
    request, and among concurrent requests. Not every engine promises this (marker batch_invariance)."""
    batched = _start(ctx)
    alone = [ctx.client.generate([p], GREEDY)[0] for p in PROMPTS]
    _assert_same(alone, batched, "batch_size_invariance (alone vs one batched request)", None)
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(ctx.client.generate, [p], GREEDY) for p in PROMPTS * 2]
        concurrent = [f.result(timeout=ctx.deadline.remaining())[0] for f in futures]
    _assert_same(alone, concurrent[: len(PROMPTS)], "batch_size_invariance (alone vs concurrent)", None)
    _assert_same(alone, concurrent[len(PROMPTS):], "batch_size_invariance (alone vs concurrent, 2nd copy)", None)


def tp_agreement(ctx: ScenarioContext) -> None:
    """TPn agrees with TP1 of the same engine within the derived bound (see bounds.tp_logprob_bound),
    at every position up to and including the first greedy divergence."""
    assert ctx.baseline is not None, "tp_agreement needs a TP1 baseline server"
    _reload(ctx, ctx.model.a)
    ok, message = ctx.baseline.update_weights_from_disk(ctx.model.a)
    assert ok, f"tp_agreement: baseline reload failed: {message}"
    mine, base = _greedy(ctx.client), _greedy(ctx.baseline)
    layers, max_logit = reference_logit_scale(ctx.model.a, [list(PROMPTS)])
    bound = tp_logprob_bound(layers, ctx.tp, max_logit)
    for prompt, m, b in zip(PROMPTS, mine, base):
        for j, (lm, lb) in enumerate(zip(m.logprobs, b.logprobs)):
            assert abs(lm - lb) <= bound, (
                f"tp_agreement: prompt {prompt!r}, token {j}: TP{ctx.tp} logprob {lm:.6f} (id {m.ids[j]}) vs TP1 "
                f"{lb:.6f} (id {b.ids[j]}) differ by {abs(lm - lb):.3e} > bound {bound:.3e}")
            if m.ids[j] != b.ids[j]:
                break


def reference_logit_scale(model_path: str, prompt_sets: list[list[str]]) -> tuple[int, float]:
    """(num_layers, max |logit|) of the fixture model on the prompts, from the reference model."""
    import torch
    from tokenizers import Tokenizer

    from reference_impl.checkpoint import load_checkpoint
    from reference_impl.model import TinyModel, shard_weights, validate_checkpoint

    ckpt = load_checkpoint(model_path)
    cfg = validate_checkpoint(ckpt)
    tok = Tokenizer.from_file(f"{model_path}/tokenizer.json")
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


SCENARIOS = (
    Scenario("reload_same_checkpoint", reload_same_checkpoint),
    Scenario("reload_different_weights", reload_different_weights),
    Scenario("failed_reload_missing_path", failed_reload_missing_path),
    Scenario("failed_reload_corrupt_checkpoint", failed_reload_corrupt_checkpoint),
    Scenario("generate_during_reload", generate_during_reload),
    Scenario("repeated_requests_deterministic", repeated_requests_deterministic),
    Scenario("batch_size_invariance", batch_size_invariance, marks=("batch_invariance",)),
    Scenario("tp_agreement", tp_agreement, needs_tp_baseline=True),
)
SCENARIOS_BY_ID = {s.id: s for s in SCENARIOS}


def run_scenario(scenario: Scenario, client: ServerClient, model: FixtureModel, baseline: ServerClient | None = None,
                 tp: int = 1, timeout_s: float | None = None, fresh: list[Generation] | None = None) -> None:
    deadline = Deadline(timeout_s or scenario.timeout_s, f"scenario {scenario.id}")
    ctx = ScenarioContext(client.with_deadline(deadline), model, deadline,
                          baseline.with_deadline(deadline) if baseline else None, tp, fresh, scenario.id)
    try:
        scenario.run(ctx)
    finally:
        ctx.client.close()
        if ctx.baseline:
            ctx.baseline.close()
