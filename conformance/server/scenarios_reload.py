"""The reload scenarios: reloading the same checkpoint or other weights, reloads that must fail (a missing path,
a corrupt checkpoint, each class of damage in conformance/server/corruptions.py) with the old weights serving on,
and generation during a reload. Listed in :data:`conformance.server.scenarios.SCENARIOS`.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import pytest

from conformance.server.bf16_copies import copy_tensor_name, verify_corrupt_copy
from conformance.server.bounds import RELOAD_LOGPROB_TOL
from conformance.server.corruptions import CORRUPTIONS_BY_ID, corrupt_checkpoint, verify
from conformance.server.derive import verify_corrupt
from conformance.server.golden import PROMPTS, GoldenTruth, compare_with_golden
from conformance.server.models import work_dir
from conformance.server.scenario_context import (GREEDY_SPEC, SEEDED_SPEC, ScenarioContext, assert_same, check_golden,
                                                 check_sampled, differs, greedy, must_reload, serve_a)


def reload_same_checkpoint(ctx: ScenarioContext) -> None:
    """The engine's own test: release memory, resume weights, reload the same checkpoint (with and then
    without flush_cache), resume kv_cache and cuda_graph; outputs identical, logprobs within 1e-4."""
    before = serve_a(ctx)
    for flush in (True, False):
        ctx.client.release_memory()
        ctx.client.resume_memory(["weights"])
        must_reload(ctx, ctx.model.a, flush_cache=flush)
        ctx.client.resume_memory(["kv_cache", "cuda_graph"])
        after = greedy(ctx.client)
        assert_same(before, after, f"reload_same_checkpoint (flush_cache={flush})", RELOAD_LOGPROB_TOL)
        check_golden(ctx, after, "a", f"reload_same_checkpoint (flush_cache={flush})")


def reload_different_weights(ctx: ScenarioContext) -> None:
    """Reloading other weights must give the golden outputs of those weights (not merely different ones), for
    greedy and for sampled requests; reloading the originals restores them bit for bit."""
    before = serve_a(ctx)
    must_reload(ctx, ctx.model.b)
    other = greedy(ctx.client)
    assert differs(before, other), (
        "reload_different_weights: outputs after loading different weights are identical to before; "
        "the reload did not take effect")
    check_golden(ctx, other, "b", "reload_different_weights: after reloading b")
    check_sampled(ctx, ctx.client.generate(list(PROMPTS), SEEDED_SPEC), "b", "reload_different_weights: seeded sampling after reloading b")
    must_reload(ctx, ctx.model.a)
    restored = greedy(ctx.client)
    assert_same(before, restored, "reload_different_weights (originals restored)", None)
    check_golden(ctx, restored, "a", "reload_different_weights: after reloading a again")


def _failed_reload(ctx: ScenarioContext, path: str, what: str) -> None:
    before = serve_a(ctx)
    result = ctx.client.reload_weights(path)
    assert not result.success, f"{what}: reload_weights({path!r}) reported success"
    assert result.message.strip(), f"{what}: a failed reload must say why (empty message)"
    after = greedy(ctx.client)
    assert_same(before, after, f"{what} (old weights must keep serving)", None)
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


def failed_reload_damaged(corruption_id: str) -> Callable[[ScenarioContext], None]:
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
    serve_a(ctx)
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
    must_reload(ctx, ctx.model.a)


def _one_prompt(truth: GoldenTruth, i: int) -> GoldenTruth:
    """The golden truth restricted to prompt ``i`` (same checkpoint, same on-demand model)."""
    from reference_impl.truth.golden import GoldenSet

    g = truth.golden
    sub = GoldenSet(g.checkpoint_digest, [g.prompt_ids[i]], *(t[i:i + 1] for t in (
        g.output_ids, g.logprobs, g.logprob_var, g.top_ids, g.top_gaps, g.route_gaps, g.route_var)))
    return GoldenTruth(truth.label, truth.path, sub, truth._exact, device=truth.device)

