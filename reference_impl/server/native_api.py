"""SGLang's native ``POST /generate`` (SGLang 0.5.23: ``GenerateReqInput`` in srt/managers/io_struct.py,
``SamplingParams`` in srt/sampling/sampling_params.py, response shaping in
srt/managers/tokenizer_manager.py).

Every sampling field SGLang accepts is either honoured or, when its value asks for something the reference
cannot do (``n`` > 1, beam search, penalties, constrained decoding, logit bias, ...), rejected with a 400 that
names the field and the supported values. Unknown fields are rejected. ``null`` means "default" for the
fields SGLang treats that way (its ``SamplingParams.__post_init__``).
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, model_validator

from reference_impl.server.api_common import MAX_BATCH, MAX_NEW_TOKENS, MAX_STOP_STRINGS, BadRequest, check_prompt, run_generate
from reference_impl.server.engine import SAMPLING_EPS, GenerateRequest, SamplingParams

MAX_TOKEN_IDS_LOGPROB = 256  # named token ids per prompt: 20,000 made a 4.7 MB answer for 8 tokens
from reference_impl.server.logprobs import LogprobRequest
from reference_impl.server.outputs import Completion, Detokenizer, TextOptions, compile_stop_regex


# Fields whose null SGLang replaces by the default (SamplingParams.__post_init__).
NULL_MEANS_DEFAULT = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                      "repetition_penalty", "min_new_tokens", "n", "ignore_eos", "skip_special_tokens",
                      "spaces_between_special_tokens", "no_stop_trim")

# field, "asks for nothing the reference lacks", supported values, why
UNSUPPORTED_VALUES: tuple[tuple[str, Callable[[Any], bool], str, str], ...] = (
    ("n", lambda v: v == 1, "1", "it returns one sequence per prompt; repeat the prompt with other sampling_seed values"),
    ("beam_width", lambda v: v in (None, 1), "null or 1", "it has no beam search"),
    ("frequency_penalty", lambda v: v == 0, "0.0", "it applies no penalties"),
    ("presence_penalty", lambda v: v == 0, "0.0", "it applies no penalties"),
    ("repetition_penalty", lambda v: v == 1, "1.0", "it applies no penalties"),
    ("json_schema", lambda v: not v, "null", "it has no constrained decoding"),
    ("regex", lambda v: not v, "null", "it has no constrained decoding"),
    ("ebnf", lambda v: not v, "null", "it has no constrained decoding"),
    ("structural_tag", lambda v: not v, "null", "it has no constrained decoding"),
    ("logit_bias", lambda v: not v, "null or {}", "it applies no logit bias"),
    ("custom_params", lambda v: not v, "null or {}", "it runs no custom logit processor"),
    ("watermark", lambda v: not v, "null", "it does not watermark"),
)


class NativeSamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # honoured
    max_new_tokens: int | None = Field(128, ge=0, le=MAX_NEW_TOKENS)  # null: the rest of the context
    min_new_tokens: int = Field(0, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    stop_regex: str | list[str] | None = None
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # no effect with a fast tokenizer (see outputs.Detokenizer)
    no_stop_trim: bool = False
    sampling_seed: int | None = Field(None, ge=0, le=2**63 - 1)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)  # the reference server's older name of sampling_seed
    stream_interval: int | None = Field(None, ge=1)  # streaming only; no effect on a non-streamed answer
    # accepted only at values that ask for nothing the reference lacks (UNSUPPORTED_VALUES)
    n: int = 1
    beam_width: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    logit_bias: dict[str, float] | None = None
    custom_params: dict[str, Any] | None = None
    watermark: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in NULL_MEANS_DEFAULT)}
        return data

    def check_supported(self) -> None:
        for name, ok, supported, why in UNSUPPORTED_VALUES:
            value = getattr(self, name)
            if not ok(value):
                raise BadRequest(f"sampling_params.{name}={value!r} is not supported by the reference server "
                                 f"({why}); supported: {supported}")

    def stops(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        def as_tuple(v):
            return () if v is None else (v,) if isinstance(v, str) else tuple(v)
        stop, regex = as_tuple(self.stop), as_tuple(self.stop_regex)
        if len(stop) > MAX_STOP_STRINGS or len(regex) > MAX_STOP_STRINGS:
            raise BadRequest(f"at most {MAX_STOP_STRINGS} stop strings and {MAX_STOP_STRINGS} stop_regex patterns")
        compile_stop_regex(regex)
        return stop, regex


class NativeGenerateIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams | list[NativeSamplingParams] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = Field(False, description="streaming is not supported")
    rid: str | list[str] | None = None


def _per_prompt(value, n: int, name: str, nested: bool = False) -> list:
    """A scalar (or, for ``nested``, a flat list) applies to every prompt; a list gives one per prompt."""
    if value is None or not isinstance(value, list) or (nested and not (value and isinstance(value[0], list))):
        return [value] * n
    if len(value) != n:
        raise BadRequest(f"{len(value)} {name} for {n} prompts")
    return value


def _prompts(body: NativeGenerateIn, detok: Detokenizer) -> tuple[list[list[int]], bool]:
    if (body.text is None) == (body.input_ids is None):
        raise BadRequest("exactly one of 'text' and 'input_ids' is required")
    if body.text is not None:
        texts = body.text if isinstance(body.text, list) else [body.text]
        if any(len(t) > 16384 for t in texts):
            raise BadRequest("text longer than 16384 characters")
        return [detok.encode(t) for t in texts], isinstance(body.text, list)
    batched = bool(body.input_ids) and isinstance(body.input_ids[0], list)
    return (body.input_ids if batched else [body.input_ids]), batched


@dataclass(frozen=True)
class NativePrompt:
    request: GenerateRequest
    text_options: TextOptions
    return_logprob: bool


def normalise(body: NativeGenerateIn, detok: Detokenizer, cfg) -> tuple[list[NativePrompt], bool]:
    if body.stream:
        raise BadRequest("streaming is not supported by the reference server")
    ids, batched = _prompts(body, detok)
    if not ids or len(ids) > MAX_BATCH:
        raise BadRequest(f"a request holds 1 to {MAX_BATCH} prompts, got {len(ids)}")
    n = len(ids)
    params = body.sampling_params
    if isinstance(params, list):
        if len(params) != n:
            raise BadRequest(f"{len(params)} sampling_params for {n} prompts")
    else:
        params = [params or NativeSamplingParams()] * n
    want_lp = _per_prompt(body.return_logprob, n, "return_logprob")
    starts = _per_prompt(body.logprob_start_len, n, "logprob_start_len")
    tops = _per_prompt(body.top_logprobs_num, n, "top_logprobs_num")
    named = _per_prompt(body.token_ids_logprob, n, "token_ids_logprob", nested=True)
    prompts = []
    for seq, p, lp, start, top, ids_lp in zip(ids, params, want_lp, starts, tops, named):
        p.check_supported()
        stop, regex = p.stops()
        max_len = cfg.max_position_embeddings
        max_new = p.max_new_tokens if p.max_new_tokens is not None else min(MAX_NEW_TOKENS, max_len - len(seq))
        check_prompt(seq, cfg.vocab_size, max_len, max_new)
        if p.min_new_tokens > max_new:
            raise BadRequest(f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {p.min_new_tokens}")
        if ids_lp is not None and len(ids_lp) > MAX_TOKEN_IDS_LOGPROB:
            raise BadRequest(f"token_ids_logprob: at most {MAX_TOKEN_IDS_LOGPROB} token ids per prompt, got "
                             f"{len(ids_lp)} (each costs one logprob per position in the answer)")
        for name, tokens in (("stop_token_ids", p.stop_token_ids or ()), ("token_ids_logprob", ids_lp or ())):
            bad = [t for t in tokens if not 0 <= t < cfg.vocab_size]
            if bad:
                raise BadRequest(f"{name}: token id {bad[0]} out of range [0, {cfg.vocab_size})")
        start = -1 if start is None else start
        if lp and start > len(seq):
            raise BadRequest(f"logprob_start_len ({start}) is higher than the number of input tokens ({len(seq)})")
        if (top or 0) < 0:
            raise BadRequest(f"top_logprobs_num must be >= 0, got {top}")
        seed = p.sampling_seed if p.sampling_seed is not None else p.seed
        temperature = 0.0 if p.temperature < SAMPLING_EPS else p.temperature
        sampling = SamplingParams(max_new, temperature, p.top_p, p.top_k, seed, p.ignore_eos,
                                  tuple(p.stop_token_ids or ()), p.min_new_tokens, p.min_p)
        extras = LogprobRequest(top or 0, tuple(ids_lp) if ids_lp is not None else None, start) if lp else LogprobRequest()
        prompts.append(NativePrompt(GenerateRequest(tuple(seq), sampling, extras),
                                    TextOptions(stop, regex, p.no_stop_trim, p.skip_special_tokens), bool(lp)))
    return prompts, batched


def _entries(pairs, text: bool, detok: Detokenizer) -> list:
    return [[lp, tok, detok.token_text(tok) if text else None] for lp, tok in pairs]


def meta_logprobs(c: Completion, req: GenerateRequest, prompt: tuple[int, ...], text: bool, detok: Detokenizer) -> dict:
    """SGLang's logprob fields of ``meta_info``: entries ``[logprob, token_id, text-or-null]``; the first
    prompt position of the window has logprob null."""
    ask, scored = req.logprobs, c.input_logprobs
    if scored is not None:
        window = prompt[scored.start:]
        input_lp = [[None, window[0], detok.token_text(window[0]) if text else None]] + _entries(
            zip(scored.logprobs, window[1:]), text, detok)
    else:
        input_lp = []
    meta = {"input_token_logprobs": input_lp,
            "output_token_logprobs": _entries(zip(c.logprobs, c.output_ids), text, detok)}
    if ask.top_k > 0:
        meta["input_top_logprobs"] = [None] + [_entries(t, text, detok) for t in scored.top] if scored else []
        meta["output_top_logprobs"] = [_entries(t, text, detok) for t in c.top_logprobs]
    if ask.token_ids is not None:
        meta["input_token_ids_logprobs"] = ([None] + [_entries(t, text, detok) for t in scored.token_ids]
                                            if scored else [])
        meta["output_token_ids_logprobs"] = [_entries(t, text, detok) for t in c.token_ids_logprobs]
    return meta


def register(app: FastAPI, scheduler, detok: Detokenizer, cfg) -> None:
    engine = scheduler.rt.engine

    @app.post("/generate")
    async def generate(body: NativeGenerateIn):
        prompts, batched = normalise(body, detok, cfg)
        rids = _per_prompt(body.rid, len(prompts), "rid")  # checked before generating, not after
        results = await run_generate(scheduler, [p.request for p in prompts])
        # stop strings and regexes are matched off the event loop (a slow pattern never delays other requests)
        finished = await asyncio.to_thread(lambda: [detok.finish(r, p.text_options) for r, p in zip(results, prompts)])
        responses = []
        for c, prompt, rid in zip(finished, prompts, rids):
            req = prompt.request
            meta = {"id": rid or uuid.uuid4().hex, "finish_reason": c.finish_reason,
                    "prompt_tokens": len(req.input_ids), "completion_tokens": len(c.output_ids),
                    "cached_tokens": 0, "weight_version": str(engine.weight_version)}
            if prompt.return_logprob:
                meta.update(meta_logprobs(c, req, req.input_ids, body.return_text_in_logprobs, detok))
            responses.append({"text": c.text, "output_ids": c.output_ids, "meta_info": meta})
        return responses if batched else responses[0]
