"""The reference server's HTTP API in-process (FastAPI TestClient, one rank): response shapes, clear 4xx
errors for bad requests, atomic reload, memory occupation, sampling; plus the topology rules."""
from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch

from conformance.server.configs import ServerConfig, parse_configs, reference_configs
from conformance.server.dialects import make_dialect
from fixtures.make_checkpoints import ensure_checkpoints
from reference_impl.model import Layout
from reference_impl.server.parallel import LaunchConfig, RankRuntime, Topology

GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def root():
    return ensure_checkpoints()


@pytest.fixture(scope="module")
def api(root):
    from fastapi.testclient import TestClient
    from tokenizers import Tokenizer

    from reference_impl.server.app import Scheduler, create_app

    path = str(root / "dense-nvfp4_awq-a")
    runtime = RankRuntime(0, LaunchConfig(path, Topology(), "cpu"))
    scheduler = Scheduler(runtime)
    app = create_app(scheduler, Tokenizer.from_file(f"{path}/tokenizer.json"),
                     {"tokenizer_path": path, "device": "cpu", "parallel": {"tp_size": 1, "dp_size": 1, "ep_size": 1}})
    with TestClient(app) as client:
        client.root, client.engine = root, runtime.engine
        yield client
    scheduler.shutdown()


def gen(api, **body):
    return api.post("/generate", json=body)


def test_generate_shape_and_logprobs(api):
    r = gen(api, text="the city of water", sampling_params=GREEDY, return_logprob=True, return_text_in_logprobs=True)
    assert r.status_code == 200
    d = r.json()
    lps = d["meta_info"]["output_token_logprobs"]
    assert len(d["output_ids"]) == 4 and [e[1] for e in lps] == d["output_ids"]
    assert all(e[0] <= 0 and isinstance(e[2], str) for e in lps)
    assert d["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert d["meta_info"]["prompt_tokens"] == 4 and d["text"] == " ".join(e[2] for e in lps)


def test_text_and_input_ids_agree(api):
    by_text = gen(api, text="the city of water", sampling_params=GREEDY).json()
    by_ids = gen(api, input_ids=[4, 53, 5, 103], sampling_params=GREEDY).json()
    assert by_text["output_ids"] == by_ids["output_ids"]


def test_batched_request_returns_a_list(api):
    r = gen(api, text=["the city", "of water"], sampling_params=GREEDY)
    assert r.status_code == 200 and isinstance(r.json(), list) and len(r.json()) == 2


def test_seeded_sampling_is_reproducible_and_seed_dependent(api):
    params = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    runs = {s: [gen(api, text="the city", sampling_params={**params, "sampling_seed": s}).json()["output_ids"]
                for _ in range(2)] for s in (1, 2)}
    assert runs[1][0] == runs[1][1] and runs[2][0] == runs[2][1]
    assert runs[1][0] != runs[2][0]


@dataclass(frozen=True)
class BadRequestCase:
    id: str
    body: dict
    status: int
    match: str


BAD_REQUESTS = [
    BadRequestCase("neither-text-nor-ids", {"sampling_params": GREEDY}, 400, "exactly one of 'text' and 'input_ids'"),
    BadRequestCase("both-text-and-ids", {"text": "a", "input_ids": [1]}, 400, "exactly one of"),
    BadRequestCase("token-out-of-range", {"input_ids": [1, 128]}, 400, r"token id 128 out of range \[0, 128\)"),
    BadRequestCase("empty-prompt", {"input_ids": []}, 400, "a request holds 1 to 64 prompts|empty prompt"),
    BadRequestCase("too-many-new-tokens", {"text": "a", "sampling_params": {"max_new_tokens": 100000}}, 400, "max_new_tokens"),
    BadRequestCase("context-overflow", {"input_ids": [5] * 250, "sampling_params": {"max_new_tokens": 10}}, 400,
                   "exceeds the context length 256"),
    BadRequestCase("unknown-sampling-key", {"text": "a", "sampling_params": {"temprature": 0}}, 400, "temprature"),
    BadRequestCase("negative-temperature", {"text": "a", "sampling_params": {"temperature": -1}}, 400, "temperature"),
    BadRequestCase("too-many-prompts", {"text": ["a"] * 65}, 400, "1 to 64 prompts"),
    BadRequestCase("stream", {"text": "a", "stream": True}, 400, "streaming is not supported"),
    BadRequestCase("params-count", {"text": ["a", "b"], "sampling_params": [GREEDY]}, 400, "1 sampling_params for 2 prompts"),
]


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c.id for c in BAD_REQUESTS])
def test_bad_request_gets_clear_4xx(api, case):
    r = gen(api, **case.body)
    assert r.status_code == case.status, r.text
    assert re.search(case.match, r.json()["error"]), r.json()


def test_oversized_body_is_413(api):
    r = api.post("/generate", content=b"{" + b" " * (1 << 20) + b"}", headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_failed_reload_is_atomic_and_reports(api):
    before = gen(api, text="the city", sampling_params=GREEDY).json()["output_ids"]
    r = api.post("/update_weights_from_disk", json={"model_path": str(api.root / "dense-nvfp4_awq-corrupt")})
    assert r.status_code == 400 and r.json()["success"] is False
    assert "missing tensor 'model.layers.1.mlp.down_proj.weight_scale'" in r.json()["message"]
    assert gen(api, text="the city", sampling_params=GREEDY).json()["output_ids"] == before
    r = api.post("/update_weights_from_disk", json={"model_path": str(api.root / "moe-nvfp4_awq-a")})
    assert r.json()["success"] is False and "different model config" in r.json()["message"]


def test_reload_copies_in_place(api):
    """Same shapes: the served tensors keep their storage (what captured CUDA graphs would hold)."""
    weights = api.engine.weights
    ptrs = {k: v.data_ptr() for k, v in weights.items()}
    name = "model.layers.0.self_attn.q_proj.weight"
    before = weights[name].clone()
    r = api.post("/update_weights_from_disk", json={"model_path": str(api.root / "dense-nvfp4_awq-b")})
    assert r.json()["success"] is True
    assert api.get("/get_model_info").json()["model_path"].endswith("dense-nvfp4_awq-b")
    assert not torch.equal(weights[name], before)
    assert {k: v.data_ptr() for k, v in api.engine.weights.items()} == ptrs
    r = api.post("/update_weights_from_disk", json={"model_path": str(api.root / "dense-nvfp4_awq-a")})
    assert r.json()["success"] is True and torch.equal(weights[name], before)


def test_memory_occupation_cycle(api):
    before = gen(api, text="the city", sampling_params=GREEDY).json()["output_ids"]
    assert api.post("/release_memory_occupation", json={}).status_code == 200
    r = gen(api, text="the city", sampling_params=GREEDY)
    assert r.status_code == 503 and "released" in r.json()["error"]
    r = api.post("/update_weights_from_disk", json={"model_path": str(api.root / "dense-nvfp4_awq-a")})
    assert r.json()["success"] is False and "resume_memory_occupation" in r.json()["message"]
    assert api.post("/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    assert api.post("/update_weights_from_disk", json={"model_path": str(api.root / "dense-nvfp4_awq-a"),
                                                       "flush_cache": False}).json()["success"]
    assert api.post("/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]}).status_code == 200
    assert api.post("/flush_cache").status_code == 200
    assert gen(api, text="the city", sampling_params=GREEDY).json()["output_ids"] == before


def test_unknown_memory_tag(api):
    r = api.post("/release_memory_occupation", json={"tags": ["gpu"]})
    assert r.status_code == 400 and "unknown memory tags ['gpu']" in r.json()["error"]


def test_health_and_model_info(api):
    assert api.get("/health").status_code == 200
    info = api.get("/get_model_info").json()
    assert info["is_generation"] and info["tp_size"] == 1


# ----------------------------------------------------------------------------------------- topology and configs
def test_topology_layouts():
    t = Topology(4, 2, 4)
    assert [t.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert t.layout(3) == Layout(attn_rank=1, attn_size=2, ep_rank=3, ep_size=4, moe_tp_rank=0, moe_tp_size=1)
    with pytest.raises(ValueError, match="must divide --tp 4"):
        Topology(4, 3, 1)


def test_config_parsing():
    assert parse_configs("tp1,cpu-tp2,tp4-dp4-ep4") == [
        ServerConfig(1, device="cuda", tier="cuda"), ServerConfig(2, device="cpu", tier="cpu"),
        ServerConfig(4, 4, 4, device="cuda", tier="multi_gpu")]
    with pytest.raises(ValueError, match="bad server config 'tp'"):
        parse_configs("tp")
    ids = [c.id for c in reference_configs(2) if c.tier == "multi_gpu"]
    assert ids == ["cuda-tp2", "cuda-tp2-dp2-ep2"]


def test_client_refuses_remote_hosts():
    with pytest.raises(ValueError, match="only talk to a local server"):
        make_dialect("sglang", "http://10.0.0.1:30000")
