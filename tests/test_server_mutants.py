"""Every server scenario can fail: each mutant server (tests/mutant_servers.py) is rejected by the named
scenario, and the correct-but-different server is accepted by all scenarios it touches."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conformance.server.launcher import ServerProcess
from conformance.server.client import ServerClient
from conformance.server.models import FixtureModel, ensure_fixture_root
from conformance.server.scenarios import SCENARIOS_BY_ID, fresh_outputs, run_scenario

MUTANT_SCRIPT = Path(__file__).resolve().parent / "mutant_servers.py"
TEMPLATE = "{python} %s --mutant {mutant} --model-path {model_path} --port {port} --device cpu" % MUTANT_SCRIPT


@dataclass(frozen=True)
class MutantCase:
    id: str
    mutant: str
    family: str
    scenario: str
    caught: bool  # True: the scenario must fail; False: it must pass
    match: str = ""


CASES = [
    MutantCase("keeps-old-weights", "reload_keeps_old_weights", "dense-nvfp4_awq", "reload_different_weights", True,
               r"reload_different_weights: outputs after loading different weights are identical"),
    MutantCase("keeps-old-weights-reload", "reload_keeps_old_weights", "dense-nvfp4_awq", "reload_same_checkpoint", True,
               r"reload_same_checkpoint \(flush_cache=True\)"),
    MutantCase("drops-awq-scale", "reload_drops_awq_scale", "dense-nvfp4_awq", "reload_same_checkpoint", True,
               r"reload_same_checkpoint: reloaded dense-nvfp4_awq-a vs the fresh start-up: prompt"),
    MutantCase("drops-awq-scale-moe", "reload_drops_awq_scale", "moe-nvfp4_awq", "reload_same_checkpoint", True,
               r"reload_same_checkpoint: reloaded moe-nvfp4_awq-a vs the fresh start-up: prompt"),
    MutantCase("nondeterministic", "nondeterministic_reduction", "dense-nvfp4_awq", "repeated_requests_deterministic", True,
               # the first repeat is the reload-vs-fresh comparison at the scenario's start
               r"repeated_requests_deterministic(: reloaded .* vs the fresh start-up| \(repeat \d\))"),
    MutantCase("drops-requests", "drops_requests_during_reload", "dense-nvfp4_awq", "generate_during_reload", True,
               r"generate_during_reload: request \d+ sent during the reload .* was lost or cut short"),
    MutantCase("half-loaded", "half_loaded_on_failure", "dense-nvfp4_awq", "failed_reload_corrupt_checkpoint", True,
               r"failed_reload_corrupt_checkpoint \(old weights must keep serving\)"),
    MutantCase("half-loaded-moe", "half_loaded_on_failure", "moe-w4a16_nvfp4", "failed_reload_corrupt_checkpoint", True,
               r"failed_reload_corrupt_checkpoint \(old weights must keep serving\)"),
    MutantCase("batch-dependent", "batch_dependent_numerics", "dense-nvfp4_awq", "batch_size_invariance", True,
               r"batch_size_invariance \(alone vs one batched request\)"),
    MutantCase("batch-dependent-is-deterministic", "batch_dependent_numerics", "dense-nvfp4_awq",
               "repeated_requests_deterministic", False),
    # the awq mutant is invisible without AWQ scales: the scenario must not fail spuriously
    MutantCase("drops-awq-scale-on-non-awq", "reload_drops_awq_scale", "moe-w4a16_nvfp4", "reload_same_checkpoint", False),
    MutantCase("rebinding-reload-same", "rebinding_reload", "dense-nvfp4_awq", "reload_same_checkpoint", False),
    MutantCase("rebinding-reload-different", "rebinding_reload", "dense-nvfp4_awq", "reload_different_weights", False),
    MutantCase("rebinding-reload-concurrent", "rebinding_reload", "dense-nvfp4_awq", "generate_during_reload", False),
]


@pytest.fixture(scope="module")
def servers():
    root = ensure_fixture_root(None)
    live: dict[tuple[str, str], ServerProcess] = {}
    fresh: dict[tuple[str, str], list] = {}

    def get(mutant: str, family: str):
        model = FixtureModel(family, root)
        key = (mutant, family)
        if key not in live:
            live[key] = ServerProcess(TEMPLATE, 240.0, mutant=mutant, model_path=model.a)
            fresh[key] = fresh_outputs(ServerClient(live[key].url))
        return ServerClient(live[key].url), model, fresh[key]

    yield get
    for server in live.values():
        server.stop()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_mutant_server(servers, case: MutantCase):
    client, model, fresh = servers(case.mutant, case.family)
    scenario = SCENARIOS_BY_ID[case.scenario]
    if case.caught:
        with pytest.raises(AssertionError, match=case.match):
            run_scenario(scenario, client, model, timeout_s=90, fresh=fresh)
    else:
        run_scenario(scenario, client, model, timeout_s=90, fresh=fresh)


def test_mutant_script_rejects_unknown_mutant():
    import subprocess

    r = subprocess.run([sys.executable, str(MUTANT_SCRIPT), "--mutant", "nope"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "usage" in r.stderr


# ----------------------------------------------------------------------------------------- tp_agreement
class _FakeServer:
    """A stand-in client returning fixed greedy outputs (mutant servers run a single rank, so TP mutants
    are emulated at the client level)."""

    def __init__(self, outputs):
        self.outputs = outputs

    def with_deadline(self, _deadline):
        return self

    def close(self):
        pass

    def update_weights_from_disk(self, _path, flush_cache=True):
        return True, "ok"

    def generate(self, prompts, _params, return_logprob=True):
        return self.outputs[: len(prompts)]


def _outputs(shift: float, diverge_at: int | None = None):
    from conformance.server.client import Generation
    from conformance.server.scenarios import PROMPTS

    outs = []
    for _ in PROMPTS:
        ids = [5, 6, 7, 8, 9, 10, 11, 12]
        if diverge_at is not None:
            ids[diverge_at] = 99
        outs.append(Generation("x", tuple(ids), tuple(-1.0 + shift for _ in ids)))
    return outs


@pytest.mark.parametrize("shift,diverge_at,caught", [(0.0, None, False), (0.05, 3, False), (2.0, None, True)],
                         ids=["identical", "divergence-within-bound", "beyond-bound"])
def test_tp_agreement_bound(shift, diverge_at, caught):
    from conformance.server.scenarios import SCENARIOS_BY_ID

    root = ensure_fixture_root(None)
    model = FixtureModel("dense-nvfp4_awq", root)
    tpn, tp1 = _FakeServer(_outputs(shift, diverge_at)), _FakeServer(_outputs(0.0))
    run = lambda: run_scenario(SCENARIOS_BY_ID["tp_agreement"], tpn, model, baseline=tp1, tp=2, timeout_s=60)  # noqa: E731
    if caught:
        with pytest.raises(AssertionError, match=r"tp_agreement: prompt .* token 0: TP2 logprob .* > bound"):
            run()
    else:
        run()
