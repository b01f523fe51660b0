"""The reference server's native ``/generate`` speaks what SGLang 0.5.23 sends: every sampling field is
honoured or refused by name, and SGLang's own client (``sglang.RuntimeEndpoint`` + ``sgl.function``) works
against it. Expected values come from other requests to the same server (greedy outputs, the full
distribution via ``top_logprobs_num``) or from the tokenizer, never from the code under test's helpers."""
from __future__ import annotations

import math
import re

import pytest
import requests

from fixtures.make_checkpoints import ensure_checkpoints
from reference_impl.server.native_api import UNSUPPORTED_VALUES, NativeSamplingParams
from tests.server.live_reference_server import live_reference_server

PROMPT = "the city of water"
UNK_PROMPT = "a new river and the old stone tree"  # its greedy output holds <unk> (id 3), a special token
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
SPECIAL_WORDS = ("<s>", "</s>", "<unk>", "<pad>")
# SamplingParams fields SGLang fills itself (normalize / __post_init__), not part of its API
SGLANG_INTERNAL_FIELDS = {"stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len", "is_normalized",
                          "ebnf_full_assistant"}


@pytest.fixture(scope="module")
def server():
    with live_reference_server(ensure_checkpoints() / "dense-nvfp4_awq-a") as (url, engine):
        http = requests.Session()
        http.trust_env = False
        http.url, http.engine = url, engine
        yield http


def generate(server, **body) -> requests.Response:
    return server.post(server.url + "/generate", json=body, timeout=60)


def ok(server, **body) -> dict:
    r = generate(server, **body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def greedy(server) -> dict:
    return ok(server, text=PROMPT, sampling_params=GREEDY, return_logprob=True)


# ----------------------------------------------------------------------------------------- every field
def sglang_sampling_fields() -> set[str]:
    """The API fields of the installed SGLang's SamplingParams, read from its source (importing sglang.srt
    takes seconds): the annotated class attributes, minus the ones SGLang fills itself."""
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed (ci/install-test-deps.sh installs it)")
    source = Path(spec.submodule_search_locations[0], "srt", "sampling", "sampling_params.py").read_text()
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "SamplingParams")
    fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert "max_new_tokens" in fields and "sampling_seed" in fields, "could not read SGLang's SamplingParams"
    return fields - SGLANG_INTERNAL_FIELDS


def test_every_sglang_sampling_field_is_known():
    """Drift check against the installed SGLang: a field SGLang adds must be honoured or refused here."""
    assert sglang_sampling_fields() - set(NativeSamplingParams.model_fields) == set()


BAD_VALUES = {"n": 2, "beam_width": 2, "frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.2,
              "json_schema": '{"type": "string"}', "regex": "a+", "ebnf": 'root ::= "a"', "structural_tag": "{}",
              "logit_bias": {"5": 2.0}, "custom_params": {"k": 1}, "watermark": {"enabled": True}}


def test_bad_value_cases_cover_the_table():
    assert set(BAD_VALUES) == {name for name, *_ in UNSUPPORTED_VALUES}


@pytest.mark.parametrize("field", sorted(BAD_VALUES))
def test_unsupported_value_is_refused_by_name(server, field):
    r = generate(server, text=PROMPT, sampling_params={**GREEDY, field: BAD_VALUES[field]})
    assert r.status_code == 400, r.text
    supported = next(s for name, _, s, _ in UNSUPPORTED_VALUES if name == field)
    assert re.search(rf"sampling_params\.{field}=.* is not supported .*; supported: {re.escape(supported)}$",
                     r.json()["error"]), r.json()


def test_unknown_field_is_still_refused(server):
    r = generate(server, text=PROMPT, sampling_params={**GREEDY, "top_kk": 2})
    assert r.status_code == 400 and "top_kk" in r.json()["error"]


def test_what_sglangs_client_sends_is_accepted(server, greedy):
    """The exact sampling_params SGLang's RuntimeEndpoint.generate builds for sgl.gen(temperature=0)."""
    import sglang.lang.ir as ir  # CI installs sglang (ci/install-test-deps.sh): missing is an error, not a skip
    params = ir.SglSamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    body = {"skip_special_tokens": True, "spaces_between_special_tokens": True, **params.to_srt_kwargs()}
    assert {"n", "stop", "min_new_tokens", "stop_regex", "json_schema"} <= set(body)
    d = ok(server, text=PROMPT, sampling_params=body, return_logprob=True)
    assert d["output_ids"] == greedy["output_ids"]


def test_null_means_default(server):
    seeded = {"max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 7}
    nulls = {k: None for k in ("temperature", "top_p", "top_k", "min_p", "n", "min_new_tokens", "no_stop_trim")}
    assert ok(server, text=PROMPT, sampling_params={**seeded, **nulls})["output_ids"] == \
        ok(server, text=PROMPT, sampling_params=seeded)["output_ids"]


# ----------------------------------------------------------------------------------------- stops
@pytest.fixture(scope="module")
def tokenizer(server):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(f"{server.engine.model_path}/tokenizer.json")


def test_stop_string_cuts_and_trims(server, greedy, tokenizer):
    ids, text = greedy["output_ids"], greedy["text"]
    word = text.split()[3]
    n = next(k for k in range(1, len(ids) + 1) if word in tokenizer.decode(ids[:k]))  # tokens through the match
    for no_trim in (False, True):
        d = ok(server, text=PROMPT, sampling_params={**GREEDY, "stop": [word], "no_stop_trim": no_trim}, return_logprob=True)
        assert d["output_ids"] == ids[:n] and len(d["meta_info"]["output_token_logprobs"]) == n
        assert d["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
        cut = text.find(word)
        assert d["text"] == (text[: cut + len(word)] if no_trim else text[:cut])


def test_stop_regex_cuts(server, greedy, tokenizer):
    ids, text = greedy["output_ids"], greedy["text"]
    word = text.split()[2]
    pattern = rf"\b{word}\b"
    n = next(k for k in range(1, len(ids) + 1) if re.search(pattern, tokenizer.decode(ids[:k])))
    d = ok(server, text=PROMPT, sampling_params={**GREEDY, "stop_regex": pattern})
    assert d["output_ids"] == ids[:n] and d["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert d["text"] == text[: re.search(pattern, text).start()]


def test_bad_stop_regex_is_refused(server):
    r = generate(server, text=PROMPT, sampling_params={**GREEDY, "stop_regex": "(unclosed"})
    assert r.status_code == 400 and "invalid stop_regex" in r.json()["error"]


def test_stop_token_ids_and_min_new_tokens(server, greedy, tokenizer):
    ids = greedy["output_ids"]
    stop = ids[2]
    assert stop not in ids[:2], "precondition: the stop token first appears at position 2"
    params = {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [stop]}
    d = ok(server, text=PROMPT, sampling_params=params)
    assert d["output_ids"] == ids[:3] and d["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert d["text"] == tokenizer.decode(ids[:2])  # the matched stop token is trimmed from the text
    assert ok(server, text=PROMPT, sampling_params={**params, "no_stop_trim": True})["text"] == tokenizer.decode(ids[:3])
    # min_new_tokens masks the stop token (and EOS) for its first tokens: the output runs past position 2
    d = ok(server, text=PROMPT, sampling_params={**params, "min_new_tokens": 5})
    assert d["output_ids"][:2] == ids[:2] and stop not in d["output_ids"][:5] and len(d["output_ids"]) >= 5


def test_min_new_tokens_over_max_is_refused(server):
    r = generate(server, text=PROMPT, sampling_params={"max_new_tokens": 2, "min_new_tokens": 3})
    assert r.status_code == 400 and "min_new_tokens" in r.json()["error"]


def test_null_max_new_tokens_fills_the_context(server):
    d = ok(server, input_ids=[5] * 250, sampling_params={"max_new_tokens": None, "temperature": 0, "ignore_eos": True})
    assert len(d["output_ids"]) == 256 - 250


def test_skip_special_tokens(server, tokenizer):
    ids = ok(server, text=UNK_PROMPT, sampling_params=GREEDY)["output_ids"]
    assert 3 in ids, "precondition: the output holds <unk>"
    shown = ok(server, text=UNK_PROMPT, sampling_params={**GREEDY, "skip_special_tokens": False})["text"]
    hidden = ok(server, text=UNK_PROMPT, sampling_params={**GREEDY, "skip_special_tokens": True})["text"]
    assert "<unk>" in shown.split() and not set(hidden.split()) & set(SPECIAL_WORDS)
    assert hidden.split() == [w for w in shown.split() if w not in SPECIAL_WORDS]


# ----------------------------------------------------------------------------------------- logprobs
def test_top_logprobs_are_the_distribution(server, greedy):
    vocab = server.engine.cfg.vocab_size
    d = ok(server, text=PROMPT, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=vocab,
           token_ids_logprob=[4, 5, 2], return_text_in_logprobs=True)
    meta = d["meta_info"]
    assert d["output_ids"] == greedy["output_ids"]
    for pos, (chosen, top, named) in enumerate(zip(meta["output_token_logprobs"], meta["output_top_logprobs"],
                                                  meta["output_token_ids_logprobs"])):
        lps = [e[0] for e in top]
        assert len(top) == vocab and lps == sorted(lps, reverse=True)
        assert abs(math.fsum(math.exp(x) for x in lps) - 1.0) < 1e-9, f"position {pos}: not a distribution"
        assert top[0][:2] == chosen[:2], f"position {pos}: greedy token is not the most likely"
        by_id = {e[1]: e[0] for e in top}
        assert [(e[0], e[1]) for e in named] == [(by_id[t], t) for t in (4, 5, 2)]
        assert all(isinstance(e[2], str) for e in top)
    k = ok(server, text=PROMPT, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=3)["meta_info"]
    assert k["output_top_logprobs"] == [[[e[0], e[1], None] for e in t[:3]] for t in meta["output_top_logprobs"]]


def test_prompt_logprobs_equal_prefix_generation(server):
    """input_token_logprobs[j] (from one forward over the prompt) equals the logprob of prompt[j] as the
    next token of prompt[:j]. The reference accumulates in fp64 and does not depend on packing, so equal."""
    prompt = [4, 53, 5, 103, 58, 49, 7, 9]
    for start in (0, 3):
        meta = ok(server, input_ids=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0},
                  return_logprob=True, logprob_start_len=start, top_logprobs_num=2)["meta_info"]
        scored = meta["input_token_logprobs"]
        assert [e[1] for e in scored] == prompt[start:] and scored[0][0] is None
        assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(scored)
        for j in range(start + 1, len(prompt)):
            nxt = ok(server, input_ids=prompt[:j], sampling_params={"max_new_tokens": 1, "temperature": 0},
                     return_logprob=True, token_ids_logprob=[prompt[j]])["meta_info"]["output_token_ids_logprobs"]
            assert scored[j - start][0] == nxt[0][0][0], f"prompt position {j}"
    assert ok(server, input_ids=prompt, sampling_params={"max_new_tokens": 1}, return_logprob=True)["meta_info"][
        "input_token_logprobs"] == []
    r = generate(server, input_ids=prompt, return_logprob=True, logprob_start_len=9)
    assert r.status_code == 400 and "logprob_start_len (9) is higher than the number of input tokens (8)" in r.text


def test_per_prompt_logprob_options(server):
    d = ok(server, text=[PROMPT, UNK_PROMPT], sampling_params=GREEDY, return_logprob=[True, False],
           top_logprobs_num=[2, 0])
    assert len(d[0]["meta_info"]["output_top_logprobs"][0]) == 2 and "output_token_logprobs" not in d[1]["meta_info"]
    r = generate(server, text=[PROMPT, UNK_PROMPT], return_logprob=[True])
    assert r.status_code == 400 and "1 return_logprob for 2 prompts" in r.json()["error"]


# ----------------------------------------------------------------------------------------- SGLang's own client
@pytest.fixture(scope="module")
def sgl_backend(server):
    import sglang as sgl  # installed by ci/install-test-deps.sh: a missing client is an error, not a skip
    return sgl, sgl.RuntimeEndpoint(server.url)


def test_sglang_client_greedy_gen(server, sgl_backend):
    sgl, backend = sgl_backend

    @sgl.function
    def answer(s, prompt):
        s += prompt + sgl.gen("answer", max_tokens=8, temperature=0)

    state = answer.run(prompt=PROMPT, backend=backend)
    native = ok(server, text=PROMPT, sampling_params={"max_new_tokens": 8, "temperature": 0})
    assert state["answer"] == native["text"] and state["answer"]
    assert state.get_meta_info("answer")["completion_tokens"] == len(native["output_ids"])


def test_sglang_client_run_batch_and_select(server, sgl_backend):
    sgl, backend = sgl_backend
    prompts = ["the city", "of water", "music of the sea"]

    @sgl.function
    def answer(s, prompt):
        s += prompt + sgl.gen("answer", max_tokens=6, temperature=0)

    states = answer.run_batch([{"prompt": p} for p in prompts], backend=backend, num_threads=3)
    natives = ok(server, text=prompts, sampling_params={"max_new_tokens": 6, "temperature": 0})
    assert [s["answer"] for s in states] == [n["text"] for n in natives]
    assert all(s["answer"] for s in states), "empty answers would make the comparison vacuous"

    @sgl.function
    def pick(s):
        s += "the city of " + sgl.select("choice", choices=["water", "stone tree"])

    state = pick.run(backend=backend)  # select scores the choices with prompt logprobs (logprob_start_len)
    assert state["choice"] in ("water", "stone tree")
    scored = state.get_meta_info("choice")["input_token_logprobs"]
    assert [[e[2] for e in s[-2:]] for s in scored] == [["of", "water"], ["stone", "tree"]]
