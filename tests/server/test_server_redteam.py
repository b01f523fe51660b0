"""The red-team servers (tests/server/redteam.py, written against the golden comparison without looking at
tests/server/mutants.py): each broken one is rejected by the named scenario; the correct-but-different one
(``temperature_scaled_logprobs``: SGLang 0.5.23's default logprobs under sampling) is accepted; ``logprobs_bf16``,
once undetectable by the golden bound (below the BF16 noise every correct engine has), is now rejected by the
coarsened-logprob check (conformance/server/fidelity.py: every logprob on the bfloat16 grid).

Verdicts of the whole red team, before and after this module's scenario changes, are in docs/server.md
("Red team"); the cases here are the ones that matter and are not covered by tests/server/test_server_mutants.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from conformance.server.dialects import make_dialect
from conformance.server.launcher import ServerProcess
from conformance.server.models import ModelCatalog
from conformance.server.scenarios import SCENARIOS_BY_ID, fresh_outputs, run_scenario

pytestmark = pytest.mark.integration  # starts servers or whole pytest runs (ci/time_tests.py times them apart)

SCRIPT = Path(__file__).resolve().parent / "redteam.py"
TEMPLATE = ("{python} %s --bug {bug} --model-path {model_path} --tokenizer-path {tokenizer_path} --port {port} "
            "--tp {tp} --device cpu" % SCRIPT)
GOLDEN = r"vs the reference's golden outputs of weight set"
SAMPLED = r"vs the reference's logprobs of the sampled tokens under weight set"


@dataclass(frozen=True)
class RedTeamCase:
    bug: str
    family: str
    scenario: str
    match: str | None  # the failure expected; None: the scenario must pass
    tp: int = 1


CASES = [
    # under sampling, the chosen token reported with the top-1 token's logprob (greedy outputs are unaffected)
    RedTeamCase("sampled_logprob_of_top1", "dense-nvfp4_awq", "repeated_requests_deterministic",
                rf"repeated_requests_deterministic: seeded sampling {SAMPLED} 'a'.*is not the reference's logprob"),
    # after a reload, sampled requests are served by the old weights (greedy ones by the new)
    RedTeamCase("old_weights_for_sampling", "dense-nvfp4_awq", "reload_different_weights",
                rf"reload_different_weights: seeded sampling after reloading b {SAMPLED} 'b'"),
    # after a reload, batched requests are served by the old weights (a replica / graph the reload forgot)
    RedTeamCase("old_weights_for_batches", "dense-nvfp4_awq", "reload_different_weights",
                r"reload_different_weights: outputs after loading different weights are identical"),
    # a reload that keeps the old per-tensor scales (weight_scale_2) and, on MoE, the old router or one expert
    RedTeamCase("stale_weight_scale_2", "dense-nvfp4_awq", "reload_different_weights",
                rf"reload_different_weights: after reloading b {GOLDEN} 'b'"),
    RedTeamCase("stale_router", "moe-w4a16_nvfp4", "reload_different_weights",
                rf"reload_different_weights: after reloading b {GOLDEN} 'b'"),
    RedTeamCase("stale_one_expert", "moe-w4a16_nvfp4", "reload_different_weights",
                rf"reload_different_weights: after reloading b {GOLDEN} 'b'"),
    # success answered at once, weights applied 20 ms later (between batches): the next request sees the old
    RedTeamCase("async_reload_20ms", "dense-nvfp4_awq", "reload_different_weights",
                r"reload_different_weights: outputs after loading different weights are identical"),
    # TP2 all-reduce without rank 1's partial sums
    RedTeamCase("tp_drops_rank1_partial", "dense-nvfp4_awq", "reload_same_checkpoint",
                rf"reload_same_checkpoint: the fresh start-up {GOLDEN} 'a'", tp=2),
    # accepted: SGLang's default sampled logprobs
    RedTeamCase("temperature_scaled_logprobs", "dense-nvfp4_awq", "repeated_requests_deterministic", None),
    RedTeamCase("temperature_scaled_logprobs", "dense-nvfp4_awq", "reload_different_weights", None),
    RedTeamCase("logprobs_bf16", "dense-nvfp4_awq", "repeated_requests_deterministic",
                r"the returned logprobs are coarsened: all \d+ of them lie on the bfloat16 grid"),
]


@pytest.fixture(scope="module")
def servers():
    catalog = ModelCatalog([], None, [], None)
    live: dict[tuple, tuple[ServerProcess, list]] = {}

    def get(case: RedTeamCase):
        model = catalog.served(case.family)
        key = (case.bug, case.family, case.tp)
        if key not in live:
            for old in list(live):  # cases are grouped by server: one live at a time
                live.pop(old)[0].stop()
            server = ServerProcess(TEMPLATE, 240.0, bug=case.bug, model_path=model.a,
                                   tokenizer_path=model.tokenizer, tp=case.tp)
            live[key] = (server, fresh_outputs(make_dialect("sglang", server.url)))
        server, fresh = live[key]
        return make_dialect("sglang", server.url), model, {s: catalog.truth(model, s) for s in ("a", "b")}, fresh

    yield get
    for server, _ in live.values():
        server.stop()


def _param(case: RedTeamCase):
    return pytest.param(case, id=f"{case.bug}-{case.family}-tp{case.tp}-{case.scenario}",
                        marks=pytest.mark.xdist_group(f"redteam-{case.bug}-{case.family}-{case.tp}"))


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_redteam_server(servers, case: RedTeamCase, record_property):
    client, model, truths, fresh = servers(case)
    run = lambda: run_scenario(SCENARIOS_BY_ID[case.scenario], client, model, truths, None, case.tp,  # noqa: E731
                               timeout_s=120, fresh=fresh)
    if case.match:
        with pytest.raises(AssertionError, match=case.match):
            run()
    else:
        record_property("bound_ratio", round(run().worst_ratio, 4))


def test_unknown_bug_is_a_usage_error():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, str(SCRIPT), "--bug", "nope"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "invalid choice" in r.stderr
