"""Every server scenario can fail: each mutant server (tests/server/mutants.py) is rejected by the named
scenario through every server dialect (conformance/server/dialects.py) that has the endpoints the mutant
breaks, and the correct-but-different servers (``rebinding_reload``; ``fp32_engine``, an engine's
arithmetic) are accepted by every scenario through every dialect, at TP1 and TP2 (gloo on CPU). A scenario
a dialect cannot run skips with the dialect's reason before sending anything. The reference server speaks
all three APIs, so one mutant server serves every dialect's cases (they run one after another)."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conformance.server.dialects import DIALECTS, ReloadResult, ServerDialect, make_dialect
from conformance.server.bounds import RELOAD_LOGPROB_TOL
from conformance.server.launcher import ServerProcess
from conformance.server.models import ModelCatalog
from conformance.server.scenarios import SCENARIOS, SCENARIOS_BY_ID, fresh_outputs, run_scenario

pytestmark = pytest.mark.integration  # starts servers or whole pytest runs (ci/time_tests.py times them apart)

MUTANT_SCRIPT = Path(__file__).resolve().parent / "mutants.py"
TEMPLATE = ("{python} %s --mutant {mutant} --model-path {model_path} --tokenizer-path {tokenizer_path} --port {port} "
            "--tp {tp} --device cpu" % MUTANT_SCRIPT)
GOLDEN = r"vs the reference's golden outputs of weight set"


@dataclass(frozen=True)
class MutantCase:
    id: str
    mutant: str
    family: str
    scenario: str
    caught: bool  # True: the scenario must fail; False: it must pass
    match: str = ""
    tp: int = 1
    apis: tuple[str, ...] | None = None  # None: every dialect that can run the scenario (else: why, at the case)


CASES = [
    MutantCase("keeps-old-weights", "reload_keeps_old_weights", "dense-nvfp4_awq", "reload_different_weights", True,
               r"reload_different_weights: outputs after loading different weights are identical"),
    MutantCase("keeps-old-weights-reload", "reload_keeps_old_weights", "dense-nvfp4_awq", "reload_same_checkpoint", True,
               r"reload_same_checkpoint \(flush_cache=True\)"),
    MutantCase("drops-awq-scale", "reload_drops_awq_scale", "dense-nvfp4_awq", "reload_same_checkpoint", True,
               r"reload_same_checkpoint: reloaded dense-nvfp4_awq a vs the fresh start-up: prompt"),
    MutantCase("drops-awq-scale-moe", "reload_drops_awq_scale", "moe-nvfp4_awq", "reload_same_checkpoint", True,
               r"reload_same_checkpoint: reloaded moe-nvfp4_awq a vs the fresh start-up: prompt"),
    MutantCase("nondeterministic", "nondeterministic_reduction", "dense-nvfp4_awq", "repeated_requests_deterministic", True,
               # the first repeat is the reload-vs-fresh comparison at the scenario's start
               r"repeated_requests_deterministic(: (reloaded|start-up weights) .* vs the fresh start-up| \(repeat \d\))"),
    # sglang only: vLLM's reload sequence pauses first (/pause?mode=wait drains the queue, requests sent
    # meanwhile get 503 and the client retries them), so no request ever queues behind its reload; the
    # same class of loss on vLLM's path is pause_aborts_in_flight_requests
    MutantCase("drops-requests", "drops_requests_during_reload", "dense-nvfp4_awq", "generate_during_reload", True,
               r"generate_during_reload: request \d+ sent during the reload .* was lost or cut short", apis=("sglang",)),
    # vllm only: SGLang's reload has no pause (the native API never drains the queue). The mutant aborts the
    # requests in flight when the reload's /pause arrives: those sent before the reload, or, where the pause comes
    # late (a loaded machine: CI saw it), those sent during it; the first lost one is named either way
    MutantCase("pause-aborts", "pause_aborts_in_flight_requests", "dense-nvfp4_awq", "generate_during_reload", True,
               r"generate_during_reload: request \d+ sent (before|during) the reload .* was lost or cut short",
               apis=("vllm",)),
    MutantCase("half-loaded", "half_loaded_on_failure", "dense-nvfp4_awq", "failed_reload_corrupt_checkpoint", True,
               r"failed_reload_corrupt_checkpoint \(old weights must keep serving\)"),
    MutantCase("half-loaded-moe", "half_loaded_on_failure", "moe-w4a16_nvfp4", "failed_reload_corrupt_checkpoint", True,
               r"failed_reload_corrupt_checkpoint \(old weights must keep serving\)"),
    MutantCase("batch-dependent", "batch_dependent_numerics", "dense-nvfp4_awq", "batch_size_invariance", True,
               r"batch_size_invariance \(alone vs one batched request\)"),
    # wrong but self-consistent: only the golden outputs see them
    MutantCase("logprobs-truncated", "logprobs_truncated", "dense-nvfp4_awq", "repeated_requests_deterministic", True,
               rf"repeated_requests_deterministic: the fresh start-up {GOLDEN} 'a'.*logprob"),
    MutantCase("logprobs-next-position", "logprobs_of_next_position", "moe-w4a16_nvfp4",
               "repeated_requests_deterministic", True,
               rf"repeated_requests_deterministic: the fresh start-up {GOLDEN} 'a'.*logprob"),
    MutantCase("attention-stale-after-reload", "reload_leaves_attention_stale", "dense-nvfp4_awq",
               "reload_different_weights", True, rf"reload_different_weights: after reloading b {GOLDEN} 'b'"),
    MutantCase("attention-stale-after-reload-moe", "reload_leaves_attention_stale", "moe-w4a16_nvfp4",
               "reload_different_weights", True, rf"reload_different_weights: after reloading b {GOLDEN} 'b'"),
    # issue 37: a loader blind to damaged block scales reports success (what it serves is not judged: the
    # scenario stops at the reported success); its checks of shapes and dtypes still refuse those classes
    MutantCase("accepts-nan-block-scale", "accepts_damaged_block_scales", "dense-nvfp4_awq",
               "failed_reload_nan_block_scale", True, r"failed_reload_nan_block_scale: reload_weights\(.*\) reported success"),
    MutantCase("accepts-negative-block-scale-moe", "accepts_damaged_block_scales", "moe-w4a16_nvfp4",
               "failed_reload_negative_block_scale", True,
               r"failed_reload_negative_block_scale: reload_weights\(.*\) reported success"),
    MutantCase("damaged-scales-blind-still-refuses-wrong-shape", "accepts_damaged_block_scales", "dense-nvfp4_awq",
               "failed_reload_wrong_shape", False),
    MutantCase("async-weight-swap", "async_weight_swap", "dense-nvfp4_awq", "generate_during_reload", True,
               r"generate_during_reload: request \d+ sent after the reload .* is neither weight set's golden output"),
    # accepted
    MutantCase("batch-dependent-is-deterministic", "batch_dependent_numerics", "dense-nvfp4_awq",
               "repeated_requests_deterministic", False),
    # the awq mutant is invisible without AWQ scales: the scenario must not fail spuriously
    MutantCase("drops-awq-scale-on-non-awq", "reload_drops_awq_scale", "moe-w4a16_nvfp4", "reload_same_checkpoint", False),
    MutantCase("rebinding-reload-same", "rebinding_reload", "dense-nvfp4_awq", "reload_same_checkpoint", False),
    MutantCase("rebinding-reload-different", "rebinding_reload", "dense-nvfp4_awq", "reload_different_weights", False),
    MutantCase("rebinding-reload-concurrent", "rebinding_reload", "dense-nvfp4_awq", "generate_during_reload", False),
]
# a correct engine with another arithmetic passes every scenario, at TP1 and TP2 -- except batch invariance,
# which it does not promise (fp32 GEMMs whose blocking depends on the batch; as `-m "not batch_invariance"`).
# Through every dialect at TP1 and in tp_agreement; the other TP2 cases through sglang only: a dialect maps
# HTTP fields, the same engine answers, so TP2 through each dialect again would re-test the arithmetic only
CASES += [MutantCase(f"fp32-engine-tp{tp}-{family}-{s.id}", "fp32_engine", family, s.id, False, tp=tp,
                     apis=None if tp == 1 or s.needs_tp_baseline else ("sglang",))
          for tp in (1, 2) for family in ("dense-nvfp4_awq", "moe-w4a16_nvfp4") for s in SCENARIOS
          if not (s.needs_tp_baseline and tp == 1) and "batch_invariance" not in s.marks]



def _through_dialects(case: MutantCase) -> list[tuple[MutantCase, str]]:
    """The case through every dialect that can run its scenario (the others skip it: see below)."""
    scenario = SCENARIOS_BY_ID[case.scenario]
    return [(case, api) for api, cls in DIALECTS.items()
            if scenario.skip_reason(cls) is None and (case.apis is None or api in case.apis)]


DIALECT_CASES = [pair for case in CASES for pair in _through_dialects(case)]
MAX_LIVE = 3  # servers kept running per worker (cases through one server are usually adjacent)


def _serves_fresh_a(server: ServerProcess, model, fresh: list) -> bool:
    """Whether ``server`` serves weight set ``a`` as right after its start-up: reload ``a`` (the reference server
    speaks the sglang API), then the greedy outputs must be the fresh ones (ids, logprobs within the reload
    tolerance). False for a mutant whose broken reload or memory handling left it in another state."""
    client = make_dialect("sglang", server.url)
    try:
        if not client.reload_weights(model.a).success:
            return False
        now = fresh_outputs(client)
    except Exception:  # a broken server may answer anything
        return False
    finally:
        client.close()
    return len(now) == len(fresh) and all(
        a.ids == b.ids and a.logprobs is not None and b.logprobs is not None
        and all(abs(x - y) <= RELOAD_LOGPROB_TOL for x, y in zip(a.logprobs, b.logprobs))
        for a, b in zip(now, fresh))


@pytest.fixture(scope="module")
def servers():
    """``get(mutant, family, tp, api)``: a server of that mutant in a known state -- serving weight set ``a``, its
    outputs those of its own start-up -- whatever cases ran on it before (any order, any xdist distribution).
    A server a case failed on (a caught mutant stops mid-scenario) is checked before its next use and
    restarted when it cannot be brought back (``mark_unknown``)."""
    catalog = ModelCatalog([], None, [], None)
    live: dict[tuple, ServerProcess] = {}  # insertion order = least recently used first
    fresh: dict[tuple, dict[str, list]] = {}
    unknown: set[tuple] = set()

    def start(key, mutant, model, tp):
        while len(live) >= MAX_LIVE:
            old = next(iter(live))
            live.pop(old).stop()
            unknown.discard(old)
        live[key] = ServerProcess(TEMPLATE, 240.0, mutant=mutant, model_path=model.a,
                                  tokenizer_path=model.tokenizer, tp=tp)
        # right after start-up, through every dialect (a later "fresh" would follow some reload)
        fresh[key] = {name: fresh_outputs(make_dialect(name, live[key].url)) for name in DIALECTS}

    def get(mutant: str, family: str, tp: int, api: str):
        model = catalog.served(family)
        key = (mutant, family, tp)
        if key in live:
            live[key] = live.pop(key)
            if key in unknown:
                unknown.discard(key)
                if not _serves_fresh_a(live[key], model, fresh[key]["sglang"]):
                    live.pop(key).stop()
        if key not in live:
            start(key, mutant, model, tp)
        truths = {s: catalog.truth(model, s) for s in ("a", "b")}
        return make_dialect(api, live[key].url), model, truths, fresh[key][api]

    def mark_unknown(mutant: str, family: str, tp: int) -> None:
        unknown.add((mutant, family, tp))

    get.mark_unknown = mark_unknown
    yield get
    for server in live.values():
        server.stop()


def _param(case: MutantCase, api: str):
    # one xdist group per mutant and model: under `--dist loadgroup` a server starts in one worker only (an
    # optimisation: each case gets a server in a known state under any distribution, see `servers`)
    return pytest.param(case, api, id=f"{case.id}-{api}",
                        marks=pytest.mark.xdist_group(f"mutant-{case.mutant}-{case.family}"))


@pytest.mark.parametrize("case,api", [_param(c, api) for c, api in DIALECT_CASES])
def test_mutant_server(servers, case: MutantCase, api: str, record_property):
    client, model, truths, fresh = servers(case.mutant, case.family, case.tp, api)
    scenario = SCENARIOS_BY_ID[case.scenario]
    baseline = servers(case.mutant, case.family, 1, api)[0] if scenario.needs_tp_baseline else None
    run = lambda: run_scenario(scenario, client, model, truths, baseline, case.tp, timeout_s=120, fresh=fresh)  # noqa: E731
    try:
        if case.caught:
            with pytest.raises(AssertionError, match=case.match):
                run()
        else:
            result = run()
            record_property("bound_ratio", round(result.worst_ratio, 4))
    except BaseException:
        servers.mark_unknown(case.mutant, case.family, case.tp)
        raise
    if case.caught:  # it stopped mid-scenario: the state it left is the mutant's
        servers.mark_unknown(case.mutant, case.family, case.tp)


SKIPPED = [(s.id, api) for s in SCENARIOS for api, cls in DIALECTS.items() if s.skip_reason(cls)]


def test_every_mutant_is_caught_through_a_dialect_that_can_reach_it():
    """The dialect matrix loses no mutant and narrows none silently: every broken server is caught through
    some dialect; a case leaves out a dialect only where it says why (``apis``, known names); only the
    OpenAI API (no weight or memory endpoints) skips scenarios, and only scenarios that need them."""
    assert {c.mutant for c, _ in DIALECT_CASES if c.caught} == {c.mutant for c in CASES if c.caught}
    assert all(set(c.apis) <= set(DIALECTS) for c in CASES if c.apis)
    assert {api for _, api in SKIPPED} == {"openai"}
    assert all(SCENARIOS_BY_ID[s].needs for s, _ in SKIPPED)


@pytest.mark.parametrize("scenario_id,api", SKIPPED, ids=[f"{s}-{a}" for s, a in SKIPPED])
def test_scenario_skips_with_the_dialects_reason(scenario_id: str, api: str):
    """A scenario the API cannot run skips, naming the operation and the API's reason, before any request
    (the dialect points at a port nothing listens on: a request would fail with 'connection failed')."""
    catalog = ModelCatalog([], None, [], None)
    model = catalog.served("dense-nvfp4_awq")
    dialect = make_dialect(api, "http://127.0.0.1:1")
    with pytest.raises(pytest.skip.Exception) as info:
        run_scenario(SCENARIOS_BY_ID[scenario_id], dialect, model, {}, timeout_s=5)
    reason = str(info.value)
    assert reason.startswith(f"{scenario_id}: skipped: the {api} API cannot reload_weights")
    assert DIALECTS[api].unsupported["reload_weights"] in reason


def test_mutant_script_rejects_unknown_mutant():
    import subprocess

    r = subprocess.run([sys.executable, str(MUTANT_SCRIPT), "--mutant", "nope"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "usage" in r.stderr


# ----------------------------------------------------------------------------------------- tp_agreement
class _FakeServer(ServerDialect):
    """A stand-in dialect returning fixed greedy outputs (TP mutants emulated at the client level)."""

    name = "fake"

    def __init__(self, outputs, unsupported: dict[str, str]):  # noqa: D107 (no HTTP)
        self.outputs, self.unsupported = outputs, unsupported

    def with_deadline(self, _deadline):
        return self

    def close(self):
        pass

    def missing(self, operations):  # per instance: the API the fake stands for
        return {op: self.unsupported[op] for op in operations if op in self.unsupported}

    def model_path(self):
        return "fake"

    def reload_weights(self, _path, flush_cache=True):
        assert "reload_weights" not in self.unsupported, "reloaded through a dialect without a reload endpoint"
        return ReloadResult(True, "ok")

    def generate(self, prompts, _spec):
        return self.outputs[: len(prompts)]


def _golden_outputs(truth, shift: float = 0.0, diverge_at: int | None = None):
    """The golden outputs themselves (what a perfect server returns), optionally shifted."""
    from conformance.interfaces.server_types import Generation

    g, outs = truth.golden, []
    for i in range(len(g.prompt_ids)):
        ids = [int(t) for t in g.output_ids[i]]
        lps = [float(x) + shift for x in g.logprobs[i]]
        if diverge_at is not None:
            ids[diverge_at] = int(g.top_ids[i, diverge_at, 1])
        outs.append(Generation("x", tuple(ids), tuple(lps), None, len(g.prompt_ids[i])))
    return outs


@pytest.mark.parametrize("api", ["sglang", "openai"])  # with a reload endpoint, and without (start-up weights)
@pytest.mark.parametrize("shift,caught", [(0.0, False), (2.0, True)], ids=["identical", "beyond-bound"])
def test_tp_agreement_bound(shift, caught, api):
    catalog = ModelCatalog([], None, [], None)
    model = catalog.served("dense-nvfp4_awq")
    truths = {s: catalog.truth(model, s) for s in ("a", "b")}
    unsupported = DIALECTS[api].unsupported
    tp1 = _FakeServer(_golden_outputs(truths["a"]), unsupported)
    tpn = _FakeServer(_golden_outputs(truths["a"], shift), unsupported)
    run = lambda: run_scenario(SCENARIOS_BY_ID["tp_agreement"], tpn, model, truths, baseline=tp1, tp=2,  # noqa: E731
                               timeout_s=60)
    if caught:
        with pytest.raises(AssertionError, match=r"tp_agreement: TP2 vs the reference's golden outputs"):
            run()
    else:
        run()
