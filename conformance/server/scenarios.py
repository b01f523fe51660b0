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

The context and shared steps are in :mod:`.scenario_context`, the scenarios by topic in :mod:`.scenarios_reload`
and :mod:`.scenarios_consistency`; this module lists them (:data:`SCENARIOS`) and runs one (:func:`run_scenario`).
Every name they define stays importable from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest

from conformance.interfaces.server_types import Deadline, Generation
from conformance.server.corruptions import CORRUPTIONS
from conformance.server.dialects import ServerDialect
from conformance.server.golden import GoldenResult, GoldenTruth
from conformance.server.models import ServedModel
from conformance.server.scenario_context import (  # noqa: F401 - re-exported: the names this module offered
    ATTACHED_STARTUP_S, GREEDY_SPEC, RELEASE_RESUME, RELOAD, SEEDED_SPEC, ScenarioContext, calibrate, check_golden,
    check_sampled, fresh_outputs, serve_a)
from conformance.server.scenarios_consistency import (  # noqa: F401 - re-exported
    CONCURRENT_ROUNDS, RunningGauge, batch_size_invariance, reference_logit_scale, repeated_requests_deterministic,
    tp_agreement)
from conformance.server.scenarios_reload import (  # noqa: F401 - re-exported
    failed_reload_corrupt_checkpoint, failed_reload_damaged, failed_reload_missing_path, generate_during_reload,
    reload_different_weights, reload_same_checkpoint)

RESTORE_TIMEOUT_S = 20.0  # after a failed scenario: bring the server back to serving, whatever the deadline left


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
    *(Scenario(f"failed_reload_{c.id}", failed_reload_damaged(c.id), needs=RELOAD)
      for c in CORRUPTIONS if c.id != "corrupt_checkpoint"),
    Scenario("generate_during_reload", generate_during_reload, needs=RELOAD),
    Scenario("repeated_requests_deterministic", repeated_requests_deterministic),
    Scenario("batch_size_invariance", batch_size_invariance, marks=("batch_invariance",)),
    Scenario("tp_agreement", tp_agreement, needs_tp_baseline=True),
)
SCENARIOS_BY_ID = {s.id: s for s in SCENARIOS}


def workload_scenario(workload, device: str | None, report_dir=None, precision: str = "fp64") -> Scenario:
    """The scenario of ``--workload``: ``workload`` sent and judged position by position
    (conformance/server/workload_scenario.py)."""
    def run(ctx: ScenarioContext) -> None:
        from conformance.server.workload_scenario import run_workload

        serve_a(ctx)  # weight set a serving (reloaded where the API can), as every scenario starts
        coverage = run_workload(ctx, workload, device, report_dir, precision)
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
