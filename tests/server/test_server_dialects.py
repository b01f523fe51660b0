"""The scenario suite's server dialects (conformance/server/dialects.py) against the reference server, which
serves all three APIs: every dialect generates the same tokens and logprobs; weight reload and memory
release/resume work through the dialects that have them and raise DialectUnsupported (with the reason)
through the one that does not; a server answer the dialect cannot trust fails with AssertionError."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from conformance.interfaces.server_types import Deadline
from conformance.server.dialects import (
    DIALECTS,
    MEMORY_TAGS,
    DialectUnsupported,
    OpenAIDialect,
    SamplingSpec,
    VLLMDialect,
    make_dialect,
)
from fixtures.make_checkpoints import ensure_checkpoints
from tests.server.live_reference_server import live_reference_server

PROMPTS = ("the city of water", "a new river and the old stone tree", "people of the north")
GREEDY = SamplingSpec(max_new_tokens=6)
SEEDED = SamplingSpec(max_new_tokens=6, temperature=0.8, top_p=0.95, seed=1234)
OPERATIONS = ("reload_weights", "release_memory", "resume_memory", "flush_cache")
WITH_WEIGHTS = [name for name, cls in DIALECTS.items() if not cls.unsupported]


def tokens(gens) -> list[tuple]:
    """What must agree across dialects (finish_reason is each API's own shape: a dict or a string)."""
    return [(g.text, g.ids, g.logprobs) for g in gens]


@pytest.fixture(scope="module")
def root():
    return ensure_checkpoints()


@pytest.fixture(scope="module")
def url(root):
    with live_reference_server(root / "dense-nvfp4_awq-a") as (base, _engine):
        yield base


@pytest.fixture(params=sorted(DIALECTS))
def dialect(request, url):
    d = make_dialect(request.param, url)
    yield d
    d.close()


@pytest.fixture(scope="module")
def reference(url):
    """Greedy and seeded outputs through the native API, one prompt at a time."""
    d = make_dialect("sglang", url)
    return {spec: [d.generate([p], spec)[0] for p in PROMPTS] for spec in (GREEDY, SEEDED)}


def test_dialect_names():
    assert sorted(DIALECTS) == ["openai", "sglang", "vllm"]
    with pytest.raises(ValueError, match="unknown server API 'tgi'; known:"):
        make_dialect("tgi", "http://127.0.0.1:1")
    with pytest.raises(ValueError, match="only talk to a local server"):
        make_dialect("vllm", "http://10.0.0.1:8000")


def test_health_and_model_path(dialect, root):
    assert dialect.healthy()
    assert dialect.model_path() == str(root / "dense-nvfp4_awq-a")


@pytest.mark.parametrize("spec", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_same_tokens_and_logprobs_through_every_dialect(dialect, reference, spec):
    batched = dialect.generate(PROMPTS, spec)  # one request carrying the batch
    for prompt, got, want in zip(PROMPTS, batched, reference[spec]):
        assert got.ids == want.ids and got.logprobs == want.logprobs and got.text == want.text, prompt
        assert len(got.ids) == spec.max_new_tokens and len(got.logprobs) == len(got.ids)


def test_unsupported_operations_say_why(dialect):
    for op in OPERATIONS:
        if op not in dialect.unsupported:
            continue
        with pytest.raises(DialectUnsupported) as info:
            getattr(dialect, op)(*(["/x"] if op == "reload_weights" else []))
        assert info.value.operation == op and info.value.reason == dialect.unsupported[op]
        assert f"the {dialect.name} API cannot {op}: " in str(info.value)


@pytest.mark.parametrize("name", WITH_WEIGHTS)
def test_reload_through_dialect(url, root, reference, name):
    d = make_dialect(name, url)
    try:
        other = d.reload_weights(str(root / "dense-nvfp4_awq-b"))
        assert other.success and other.message
        changed = d.generate(PROMPTS, GREEDY)
        assert [g.ids for g in changed] != [g.ids for g in reference[GREEDY]]
        failed = d.reload_weights(str(root / "dense-nvfp4_awq-corrupt"))
        assert not failed.success and "missing tensor" in failed.message
        assert tokens(d.generate(PROMPTS, GREEDY)) == tokens(changed), "a failed reload must leave the old weights serving"
        assert not d.reload_weights(str(root / "does-not-exist")).success
    finally:
        assert d.reload_weights(str(root / "dense-nvfp4_awq-a"), flush_cache=False).success
    assert tokens(d.generate(PROMPTS, GREEDY)) == tokens(reference[GREEDY])


@pytest.mark.parametrize("name", WITH_WEIGHTS)
def test_release_resume_cycle_through_dialect(url, root, reference, name):
    """The upstream engine test's sequence: release all, resume weights, reload, resume the rest."""
    d = make_dialect(name, url)
    d.release_memory()
    with pytest.raises(AssertionError, match="answered 503"):
        d.generate(PROMPTS[:1], GREEDY)
    d.resume_memory(["weights"])
    assert d.reload_weights(str(root / "dense-nvfp4_awq-a")).success
    d.resume_memory(["kv_cache", "cuda_graph"])
    d.flush_cache()
    assert tokens(d.generate(PROMPTS, GREEDY)) == tokens(reference[GREEDY])


@pytest.mark.parametrize("name", WITH_WEIGHTS)
def test_a_scenario_failing_half_way_leaves_the_server_serving(url, root, reference, name):
    """A scenario that fails after releasing memory (or, through vllm, inside a pause) must not leave the
    server refusing every later scenario's requests: run_scenario restores serving before reporting."""
    from conformance.server.models import ModelCatalog
    from conformance.server.scenarios import Scenario, run_scenario

    d = make_dialect(name, url)

    def fails_half_way(ctx):
        ctx.client.release_memory()
        if name == "vllm":
            ctx.client._ok(ctx.client._call("POST", "/pause", params={"mode": "abort"}), "/pause")
        raise AssertionError("planted failure half-way")

    model = ModelCatalog([], None, [], None).served("dense-nvfp4_awq")
    with pytest.raises(AssertionError, match="planted failure half-way"):
        run_scenario(Scenario("fails_half_way", fails_half_way, needs=("release_memory",)), d, model, {}, timeout_s=30)
    assert d.reload_weights(str(root / "dense-nvfp4_awq-a")).success  # released weights come back zeroed
    assert tokens(d.generate(PROMPTS, GREEDY)) == tokens(reference[GREEDY])


@pytest.mark.parametrize("name", WITH_WEIGHTS)
def test_generation_during_reload_completes(url, root, reference, name):
    """Requests sent while a reload runs all complete, each equal to the old or the new weights' output
    (through vLLM's sequence the dialect retries the 503 its own pause causes)."""
    d = make_dialect(name, url)
    assert d.reload_weights(str(root / "dense-nvfp4_awq-b")).success
    new = d.generate(PROMPTS, GREEDY)
    assert d.reload_weights(str(root / "dense-nvfp4_awq-a")).success
    with ThreadPoolExecutor(max_workers=4) as pool:
        sent = [pool.submit(d.generate, [p], GREEDY) for p in PROMPTS]
        reload = pool.submit(d.reload_weights, str(root / "dense-nvfp4_awq-b"))
        sent += [pool.submit(d.generate, [p], GREEDY) for p in PROMPTS]
        assert reload.result(timeout=60).success
        got = [f.result(timeout=60)[0] for f in sent]
    for i, g in enumerate(got):
        assert tokens([g]) in (tokens([reference[GREEDY][i % 3]]), tokens([new[i % 3]])), f"request {i}"
    assert d.reload_weights(str(root / "dense-nvfp4_awq-a")).success


def test_vllm_releases_everything_or_nothing(url, root, reference):
    """vLLM sleeps as a whole; the released weights come back zeroed, so the test reloads them: the module's
    server is shared, and a later test (in any order) must find weight set a serving (a random order once ran
    the seeded-sampling comparison after this test and saw the zeroed model's tokens)."""
    d = make_dialect("vllm", url)
    with pytest.raises(DialectUnsupported, match="releases weights and KV cache together"):
        d.release_memory(["kv_cache"])
    d.release_memory(list(MEMORY_TAGS))
    try:
        d.resume_memory()
    finally:
        assert d.reload_weights(str(root / "dense-nvfp4_awq-a")).success
    assert tokens(d.generate(PROMPTS, GREEDY)) == tokens(reference[GREEDY])


def test_deadline_bounds_every_call(url):
    d = make_dialect("openai", url).with_deadline(Deadline(0.0, "scenario x"))
    with pytest.raises(AssertionError, match="scenario x: exceeded its time limit"):
        d.generate(PROMPTS[:1], GREEDY)


# ----------------------------------------------------------------------------------------- untrusted answers
CHOICE = {"index": 0, "text": "set had", "finish_reason": "length", "token_ids": [111, 28],
          "logprobs": {"tokens": ["token_id:111", "token_id:28"], "token_logprobs": [-0.5, -1.25]}}


@pytest.mark.parametrize("cls, change, match", [
    (OpenAIDialect, {"token_ids": None}, "returned no token_ids"),
    (OpenAIDialect, {"logprobs": {"token_logprobs": [-0.5]}}, "1 token_logprobs for 2 token_ids"),
    (OpenAIDialect, {"logprobs": None}, "0 token_logprobs for 2 token_ids"),
    (VLLMDialect, {"logprobs": {"tokens": ["token_id:111", "token_id:29"], "token_logprobs": [-0.5, -1.25]}},
     r"logprobs tokens .* != token_ids \[111, 28\]"),
])
def test_untrusted_completion_choice_fails(cls, change, match):
    d = cls("http://127.0.0.1:1")
    assert d._generation(CHOICE).ids == (111, 28)
    with pytest.raises(AssertionError, match=match):
        d._generation({**CHOICE, **change})


# ----------------------------------------------------------------------------------------- launching for a dialect
def test_vllm_without_dev_mode_fails_naming_it(monkeypatch):
    """A vLLM started without VLLM_SERVER_DEV_MODE answers 404 on its weight and memory endpoints: the
    scenario fails saying how to start it, rather than with a bare 404 (and never skips)."""
    import requests

    from conformance.server.dialects import ServerDialect

    missing = requests.Response()
    missing.status_code = 404
    monkeypatch.setattr(ServerDialect, "_call", lambda self, method, path, **kw: missing)
    with pytest.raises(AssertionError, match=r"GET /is_sleeping answered 404: .*VLLM_SERVER_DEV_MODE=1"):
        VLLMDialect("http://127.0.0.1:1").reload_weights("/x")


@pytest.mark.parametrize("api,expected_code", [("vllm", 0), ("sglang", 3)])
def test_launcher_sets_the_dialects_environment(monkeypatch, api, expected_code):
    """``ServerProcess(api=...)`` sets the dialect's ``launch_env`` (a stand-in server exits 0 when it sees
    VLLM_SERVER_DEV_MODE=1, 3 otherwise; the launcher reports the exit code)."""
    from conformance.server.launcher import ServerProcess, ServerStartError

    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    probe = ("{python} -c \"import os,sys; sys.exit(0 if os.environ.get('VLLM_SERVER_DEV_MODE') == '1' else 3)\"")
    with pytest.raises(ServerStartError, match=f"server exited with code {expected_code} during start-up"):
        ServerProcess(probe, 30.0, api=api)
