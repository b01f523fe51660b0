"""The reference server's OpenAI-compatible endpoints, driven by the official ``openai`` client: completions
with logprobs equal the native ``/generate`` answer (same ids, same logprobs, bit for bit), in the legacy
completions shape vLLM and SGLang use; what the reference cannot do is refused by name."""
from __future__ import annotations

import openai  # a declared test dependency (pyproject.toml): missing is an error, not a skip
import pytest
import requests

from fixtures.make_checkpoints import ensure_checkpoints
from tests.server.live_reference_server import live_reference_server

PROMPTS = ["the city of water", "a new river and the old stone tree"]
EXTRA = {"return_token_ids": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    with live_reference_server(ensure_checkpoints() / "dense-nvfp4_awq-a") as (url, engine):
        http = requests.Session()
        http.trust_env = False
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60,
                               http_client=openai.DefaultHttpxClient(trust_env=False))
        yield url, http, client, engine


@pytest.fixture(scope="module")
def model(server) -> str:
    return server[2].models.list().data[0].id


def native(server, **body) -> list[dict]:
    url, http = server[0], server[1]
    r = http.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_models_list(server, model):
    card = server[2].models.list().data[0]
    assert card.id == model == server[3].model_path and card.object == "model"
    assert card.model_extra["max_model_len"] == 256


@pytest.mark.parametrize("top", [0, 3])
def test_completion_logprobs_equal_native(server, model, top):
    client = server[2]
    out = client.completions.create(model=model, prompt=PROMPTS, max_tokens=8, temperature=0, logprobs=top,
                                    extra_body=EXTRA)
    ref = native(server, text=PROMPTS, sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
                 return_logprob=True, top_logprobs_num=max(top, 1), return_text_in_logprobs=True)
    assert [c.index for c in out.choices] == [0, 1]
    for choice, r in zip(out.choices, ref):
        meta = r["meta_info"]
        assert choice.model_extra["token_ids"] == r["output_ids"]
        assert choice.text == r["text"] and choice.finish_reason == "length"
        assert choice.logprobs.token_logprobs == [e[0] for e in meta["output_token_logprobs"]]
        assert choice.logprobs.tokens == [e[2] for e in meta["output_token_logprobs"]]
        for chosen, alts, top_native in zip(meta["output_token_logprobs"], choice.logprobs.top_logprobs,
                                            meta["output_top_logprobs"]):
            # the N most likely tokens plus the chosen one (N or N+1 entries), chosen first
            expected = {chosen[2]: chosen[0], **{e[2]: e[0] for e in top_native[:top]}}
            assert alts == expected and next(iter(alts)) == chosen[2]
        offsets = choice.logprobs.text_offset
        assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], choice.logprobs.tokens))
    assert out.usage.prompt_tokens == sum(r["meta_info"]["prompt_tokens"] for r in ref)
    assert out.usage.completion_tokens == 16 and out.usage.total_tokens == out.usage.prompt_tokens + 16


def test_seeded_sampling_equals_native(server, model):
    out = server[2].completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0.8, top_p=0.95,
                                       seed=1234, logprobs=0, extra_body=EXTRA)
    ref = native(server, text=PROMPTS[0], return_logprob=True, sampling_params={
        "max_new_tokens": 8, "temperature": 0.8, "top_p": 0.95, "sampling_seed": 1234, "ignore_eos": True})
    assert out.choices[0].model_extra["token_ids"] == ref["output_ids"]
    assert out.choices[0].logprobs.token_logprobs == [e[0] for e in ref["meta_info"]["output_token_logprobs"]]


def test_prompt_as_token_ids(server, model):
    client = server[2]
    by_text = client.completions.create(model=model, prompt=PROMPTS, max_tokens=4, temperature=0, extra_body=EXTRA)
    ids = [c.model_extra["prompt_token_ids"] for c in by_text.choices]
    for prompt in (ids, ids[0]):
        by_ids = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, extra_body=EXTRA)
        assert [c.model_extra["token_ids"] for c in by_ids.choices] == \
            [c.model_extra["token_ids"] for c in by_text.choices][: len(by_ids.choices)]


def test_echo_logprobs_are_prompt_logprobs(server, model):
    out = server[2].completions.create(model=model, prompt=PROMPTS[0], max_tokens=2, temperature=0, logprobs=2,
                                       echo=True, extra_body=EXTRA)
    ref = native(server, text=PROMPTS[0], sampling_params={"max_new_tokens": 2, "temperature": 0, "ignore_eos": True},
                 return_logprob=True, logprob_start_len=0, top_logprobs_num=2, return_text_in_logprobs=True)
    meta, lp = ref["meta_info"], out.choices[0].logprobs
    scored = meta["input_token_logprobs"] + meta["output_token_logprobs"]
    assert out.choices[0].text == PROMPTS[0] + ref["text"]
    assert lp.tokens == [e[2] for e in scored] and lp.token_logprobs == [e[0] for e in scored]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.top_logprobs[1] == {scored[1][2]: scored[1][0], **{e[2]: e[0] for e in meta["input_top_logprobs"][1]}}


def test_stop_string(server, model):
    client = server[2]
    full = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0, extra_body=EXTRA)
    word = full.choices[0].text.split()[2]
    for include in (False, True):
        out = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0, stop=[word],
                                        extra_body={**EXTRA, "include_stop_str_in_output": include})
        c = out.choices[0]
        assert c.finish_reason == "stop" and c.model_extra["stop_reason"] == word
        cut = full.choices[0].text.find(word)
        assert c.text == full.choices[0].text[: cut + len(word) if include else cut]
        assert out.usage.completion_tokens == len(c.model_extra["token_ids"]) < 8


@pytest.mark.parametrize("kwargs, status, field", [
    ({"n": 2}, 400, "n"),
    ({"best_of": 3}, 400, "best_of"),
    ({"suffix": "x"}, 400, "suffix"),
    ({"logprobs": 21}, 400, "logprobs"),
    ({"frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ({"logit_bias": {"5": 1.0}}, 400, "logit_bias"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"extra_body": {"no_such_field": 1}}, 400, "no_such_field"),
    ({"model": "other-model"}, 404, "model"),
])
def test_refused_with_the_field_named(server, model, kwargs, status, field):
    kwargs = {"model": model, "prompt": PROMPTS[0], "max_tokens": 4, **kwargs}
    error = openai.NotFoundError if status == 404 else openai.BadRequestError
    with pytest.raises(error) as info:
        server[2].completions.create(**kwargs)
    body = info.value.body
    assert info.value.status_code == status and field in body["message"], body


def test_stream_is_refused(server, model):
    r = server[1].post(server[0] + "/v1/completions", json={"model": model, "prompt": "a", "stream": True}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
