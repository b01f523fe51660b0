"""The workload scenario: the traffic a :class:`~conformance.server.workloads.Workload` names, sent as token ids so
the engine computes forwards of exactly the planned token counts, every answer judged position by position
(:mod:`conformance.server.workload_judge`), the coverage map written next to the reports.

Order (after the scenarios' common start: weight set ``a`` reloaded where the API can, checked against the
fresh start-up and the golden outputs): prefills one request at a time (M = the prompt's
length, then decode at M = 1); explicit batches of the short prompt pool (decode at M = the batch); one batch
repeated (identical answers are observed, each judged); mixed traffic (short requests decoding while a long
prompt arrives: the engine may put prefill chunks and decode rows in one forward); then, where the API can
reload, weight set ``b`` served at the reload batches and the longest prefill (every bucket must serve the new
weights), and ``a`` again.
"""
from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from conformance.interfaces.server import DialectUnsupported, SamplingSpec
from conformance.server.workload_coverage import Coverage, Planned, failure_message
from conformance.server.workload_judge import WorkloadJudge
from conformance.server.workloads import Workload

#: ExactModel per checkpoint path, kept for the session: a prompt and continuation asked again (another API,
#: another batch with the same answer) is judged from memory
_EXACT: dict[str, object] = {}
_LOCK = threading.Lock()
MIXED_DELAY_S = 0.05  # the long prompt follows the short requests by this much (they are decoding by then)


def exact_model(path: str, device: str | None):
    from reference_impl.truth.golden import ExactModel

    with _LOCK:
        if path not in _EXACT:
            _EXACT[path] = ExactModel(path, device)
        return _EXACT[path]


def run_workload(ctx, workload: Workload, device: str | None, report_dir=None, precision: str = "fp64") -> Coverage:
    """Send ``workload`` through ``ctx.client`` and judge it; raises AssertionError naming the failing buckets.
    A dialect that cannot send token ids or return prompt logprobs skips (pytest.skip) with its reason.
    ``precision``: the truth's probed passes (``--truth-precision``; reference_impl/truth/probes.py)."""
    truth = ctx.model.truth_model
    exact = {"a": exact_model(truth.a, device), "b": exact_model(truth.b, device)}
    _check(ctx, workload, exact["a"].cfg, precision)
    with _kept_layers(exact, precision):
        return _run(ctx, workload, exact, report_dir, precision)


def _kept_layers(exact: dict, precision: str):
    """fp32 probes keep each weight set's cast layers between passes, within an eighth of the truth device's memory
    (a GPU the engine under test may share); fp64 keeps none."""
    from reference_impl.truth.probes import keeping_layers

    if precision == "fp64":
        return contextlib.nullcontext()
    return keeping_layers(*(m.truth for m in exact.values()), share=1 / 8)


def _run(ctx, workload: Workload, exact: dict, report_dir, precision: str) -> Coverage:
    import pytest

    client, spec = ctx.client, SamplingSpec(workload.continuation, 0.0, ignore_eos=True)
    vocab_size = exact["a"].cfg.vocab_size
    coverage = Coverage(workload.name)
    judge = WorkloadJudge(exact, coverage, ctx.tp, workload.probes, precision, workload.screen_probes)
    pool = workload.prompts(vocab_size, workload.short_length, workload.pool_size, "pool")
    can_reload = not client.missing(("reload_weights",))

    def send(prompts, plan: list[Planned], judge_now: bool = True):
        for p in plan:
            coverage.expect(p)
        try:
            answers = client.generate_ids(prompts, spec, prompt_logprobs=True)
        except DialectUnsupported as exc:
            pytest.skip(f"{ctx.name}: {exc}")
        if len(answers) != len(prompts):
            raise AssertionError(f"{plan[0].request}: {len(answers)} answers for {len(prompts)} prompts")
        for answer, prompt, p in zip(answers, prompts, plan):
            if list(answer.prompt_ids) != list(prompt):
                raise AssertionError(f"{p.request}: the server reports prompt {list(answer.prompt_ids)[:8]}... for "
                                     f"the token ids sent {list(prompt)[:8]}...")
            if len(answer.ids) != workload.continuation:
                raise AssertionError(f"{p.request}: {len(answer.ids)} tokens generated, asked for "
                                     f"{workload.continuation} with ignore_eos")
        if judge_now:
            judge.prefetch(answers, plan)
            for answer, p in zip(answers, plan):
                judge.judge(answer, p)
        return answers if judge_now else list(zip(answers, plan))

    for length in workload.prefill_lengths:  # M = length, alone
        prompt = workload.prompts(vocab_size, length, 1, "prefill")[0]
        send([prompt], [Planned(f"prefill of {length} tokens (alone)", "a", length, 1)])
    for b in workload.decode_batches:  # decode at M = b
        send(pool[:b], [Planned(f"batch of {b}, prompt {i}", "a", b * workload.short_length, b) for i in range(b)])
    _repeated(workload, pool, send, coverage)
    mixed = _mixed(workload, pool, send, vocab_size)
    judge.prefetch([a for a, _ in mixed], [p for _, p in mixed])
    for answer, p in mixed:
        judge.judge(answer, p)
    if can_reload:
        _after_reload(ctx, workload, pool, send, vocab_size)
    else:
        coverage.notes.append(f"the {client.name} API cannot reload: the reload part of the workload was not run")
    if report_dir is not None:
        _write_coverage(ctx, coverage, report_dir)
    if coverage.failures:
        raise AssertionError(failure_message(coverage, f"{ctx.name}: workload {workload.name!r}"))
    missing = coverage.not_reached()
    if missing:
        raise AssertionError(f"{ctx.name}: workload {workload.name!r}: planned cells judged nothing: {missing}")
    return coverage


def _check(ctx, workload: Workload, cfg, precision: str) -> None:
    """The workload fits the model; ``--truth-precision fp32`` only for a dense one (else a failure with the
    reason, before any request)."""
    import pytest

    workload.check(max_positions=cfg.max_position_embeddings)
    if precision != "fp64" and cfg.top_k:
        pytest.fail(f"{ctx.name}: --truth-precision {precision} is for dense checkpoints; {ctx.model.name} routes "
                    f"(an fp32 pass may route a near-tie otherwise than the fp64 values): use fp64", pytrace=False)


def _repeated(workload: Workload, pool, send, coverage: Coverage) -> None:
    """One batch of the pool sent ``workload.repeat`` times; answers that differ between repeats are noted (each is
    judged against the truth: identical answers are not required)."""
    b, times = workload.repeat
    first = None
    for n in range(times):
        got = send(pool[:b], [Planned(f"batch of {b} (repeat {n + 1}), prompt {i}", "a", b * workload.short_length, b)
                              for i in range(b)])
        first = first or got
        if got != first:
            coverage.notes.append(f"repeat: the batch of {b} answered differently on repeat {n + 1} (each answer "
                                  f"judged against the truth; identical answers are not required)")


def _after_reload(ctx, workload: Workload, pool, send, vocab_size: int) -> None:
    """Weight set b reloaded and sent the reload batches and the longest prefill (every bucket must serve the new
    weights); weight set a reloaded back, whatever happened."""
    client = ctx.client
    assert client.reload_weights(ctx.model.b).success, f"{ctx.name}: reloading weight set b failed"
    try:
        for b in workload.reload_batches:
            send(pool[:b], [Planned(f"after a reload of b: batch of {b}, prompt {i}", "b",
                                    b * workload.short_length, b) for i in range(b)])
        longest = max(workload.prefill_lengths)
        prompt = workload.prompts(vocab_size, longest, 1, "prefill")[0]
        send([prompt], [Planned(f"after a reload of b: prefill of {longest} tokens", "b", longest, 1)])
    finally:
        assert client.reload_weights(ctx.model.a).success, f"{ctx.name}: reloading weight set a back failed"


def _write_coverage(ctx, coverage: Coverage, report_dir) -> None:
    """The coverage map written next to the reports, under a name no other config of the same API, TP size and
    model has taken."""
    stem = f"coverage-{ctx.name}-{ctx.client.name}-tp{ctx.tp}-{ctx.model.name}"
    n = 1
    while (report_dir / f"{stem}.json").exists():  # another config of the same API, TP size and model
        n += 1
        stem = f"coverage-{ctx.name}-{ctx.client.name}-tp{ctx.tp}-{ctx.model.name}-{n}"
    coverage.write(report_dir, stem)


def _mixed(workload: Workload, pool, send, vocab_size: int) -> list:
    """Short requests decoding while a long prompt arrives: their answers and plans (judged by the caller, one
    at a time)."""
    long_len, shorts = workload.mixed
    long_prompt = workload.prompts(vocab_size, long_len, 1, "prefill")[0]  # the prefill's prompt of that length
    with ThreadPoolExecutor(max_workers=shorts + 1, thread_name_prefix="mixed") as ex:
        futures = [ex.submit(send, [pool[i]], [Planned(f"mixed: short request {i}", "a", long_len, shorts + 1, True)],
                             False) for i in range(shorts)]
        time.sleep(MIXED_DELAY_S)
        futures.append(ex.submit(send, [long_prompt], [Planned(f"mixed: prompt of {long_len} tokens arriving "
                                                               f"among {shorts} decoding", "a", long_len, shorts + 1, True)], False))
        return [pair for f in futures for pair in f.result()]
