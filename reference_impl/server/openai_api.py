"""OpenAI-compatible ``GET /v1/models`` and ``POST /v1/completions`` (legacy completions), shaped as vLLM
0.33.0 answers them (vllm/entrypoints/openai/completion/{protocol,serving}.py,
vllm/entrypoints/serve/engine/protocol.py) with SGLang 0.5.23's extras
(sglang/srt/entrypoints/openai/protocol.py).

* ``prompt``: text or token ids, one or a list; one choice per prompt (``n`` must be 1).
* ``logprobs: N`` (0..20): per token ``tokens``, ``token_logprobs``, ``top_logprobs`` (the N most likely
  tokens plus the chosen one: N or N+1 entries, the OpenAI convention vLLM follows) and ``text_offset``
  (cumulative token-text lengths from 0, as vLLM). ``echo`` prepends the prompt to the text and, with
  ``logprobs``, its tokens (the first one with null logprob).
* Engine extensions both vLLM and SGLang accept: ``top_k``, ``min_p``, ``min_tokens``, ``ignore_eos``,
  ``stop_token_ids``, ``skip_special_tokens``, ``spaces_between_special_tokens``, ``return_token_ids``
  (``token_ids`` / ``prompt_token_ids`` in each choice); vLLM's ``include_stop_str_in_output`` and
  ``return_tokens_as_token_ids``; SGLang's ``no_stop_trim``.
* Errors: ``{"error": {"message", "type", "param", "code"}}`` (vLLM's ``ErrorResponse``).
"""
from __future__ import annotations

import asyncio

import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from reference_impl.server.api_common import MAX_BATCH, MAX_NEW_TOKENS, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, BadRequest, check_prompt, run_generate
from reference_impl.server.engine import GenerateRequest, SamplingParams
from reference_impl.server.logprobs import LogprobRequest
from reference_impl.server.outputs import Completion, Detokenizer, TextOptions

LOGPROB_FLOOR = -9999.0  # vLLM: -inf is not JSON; it reports this instead


class CompletionIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0, le=MAX_NEW_TOKENS)  # null: the rest of the context
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    suffix: str | None = None
    user: str | None = None  # an end-user id for the caller's bookkeeping: no effect
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # engine extensions
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool = True  # no effect with a fast tokenizer (see outputs.Detokenizer)
    include_stop_str_in_output: bool = False
    no_stop_trim: bool = False
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # vLLM: every prompt token's logprob

    def check_supported(self) -> None:
        unsupported = (  # field, value, "asks for nothing the reference lacks", supported, why
            ("n", self.n, self.n == 1, "1", "it returns one choice per prompt"),
            ("best_of", self.best_of, self.best_of in (None, 1), "null or 1", "it returns one choice per prompt"),
            ("stream", self.stream, not self.stream, "false", "it does not stream"),
            ("stream_options", self.stream_options, self.stream_options is None, "null", "it does not stream"),
            ("suffix", self.suffix, not self.suffix, "null", "it does not insert text"),
            ("frequency_penalty", self.frequency_penalty, not self.frequency_penalty, "null or 0", "no penalties"),
            ("presence_penalty", self.presence_penalty, not self.presence_penalty, "null or 0", "no penalties"),
            ("repetition_penalty", self.repetition_penalty, self.repetition_penalty in (None, 1.0), "null or 1",
             "no penalties"),
            ("logit_bias", self.logit_bias, not self.logit_bias, "null or {}", "no logit bias"),
        )
        for name, value, ok, supported, why in unsupported:
            if not ok:
                raise OpenAIError(f"{name}={value!r} is not supported by the reference server ({why}); "
                                  f"supported: {supported}", param=name)
        if self.max_tokens == 0 and not self.echo:
            raise OpenAIError("max_tokens=0 generates nothing; it is allowed with echo only", param="max_tokens")


class OpenAIError(BadRequest):
    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message, status)
        self.param = param


def error_response(exc: BadRequest) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(exc.status, "Error")
    return JSONResponse({"error": {"message": str(exc), "type": kind, "param": getattr(exc, "param", None),
                                   "code": exc.status}}, status_code=exc.status)


def _prompts(body: CompletionIn, detok: Detokenizer) -> tuple[list[list[int]], list[str]]:
    p = body.prompt
    if isinstance(p, str):
        texts = [p]
    elif p and isinstance(p[0], str):
        texts = list(p)
    else:
        ids = [p] if not p or isinstance(p[0], int) else list(p)
        return ids, [detok.decode(i) for i in ids]
    if any(len(t) > 16384 for t in texts):
        raise OpenAIError("prompt longer than 16384 characters", param="prompt")
    return [detok.encode(t) for t in texts], texts


def build_requests(body: CompletionIn, detok: Detokenizer, cfg) -> tuple[list[GenerateRequest], TextOptions, list[str]]:
    body.check_supported()
    ids, prompt_texts = _prompts(body, detok)
    if not ids or len(ids) > MAX_BATCH:
        raise OpenAIError(f"a request holds 1 to {MAX_BATCH} prompts, got {len(ids)}", param="prompt")
    stop = () if body.stop is None else (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise OpenAIError(f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
    bad = [t for t in body.stop_token_ids or () if not 0 <= t < cfg.vocab_size]
    if bad:
        raise OpenAIError(f"stop_token_ids: token id {bad[0]} out of range [0, {cfg.vocab_size})", param="stop_token_ids")
    scored = (body.echo and body.logprobs is not None) or body.prompt_logprobs is not None
    ask = LogprobRequest(top_k=max(body.logprobs or 0, body.prompt_logprobs or 0), input_start=0 if scored else -1)
    requests = []
    for seq in ids:
        max_len = cfg.max_position_embeddings
        max_new = body.max_tokens if body.max_tokens is not None else min(MAX_NEW_TOKENS, max_len - len(seq))
        try:
            check_prompt(seq, cfg.vocab_size, max_len, max_new)
        except BadRequest as exc:
            raise OpenAIError(str(exc), param="prompt") from exc
        if body.min_tokens > max_new:
            raise OpenAIError(f"min_tokens ({body.min_tokens}) exceeds max_tokens ({max_new})", param="min_tokens")
        temperature = 1.0 if body.temperature is None else body.temperature
        sampling = SamplingParams(max_new, temperature, 1.0 if body.top_p is None else body.top_p,
                                  -1 if body.top_k is None else body.top_k, body.seed, body.ignore_eos,
                                  tuple(body.stop_token_ids or ()), body.min_tokens, body.min_p or 0.0)
        requests.append(GenerateRequest(tuple(seq), sampling, ask))
    skip = True if body.skip_special_tokens is None else body.skip_special_tokens
    options = TextOptions(stop, (), body.include_stop_str_in_output or body.no_stop_trim, skip)
    return requests, options, prompt_texts


def completion_logprobs(tokens: list[int], logprobs: list[float | None], tops: list, n_top: int,
                        token_str) -> dict:
    """The legacy completions ``logprobs`` object (vLLM's ``_create_completion_logprobs``)."""
    out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    offset = 0
    for tok, lp, top in zip(tokens, logprobs, tops):
        text = token_str(tok)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if lp is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(max(lp, LOGPROB_FLOOR))
        entries = {text: max(lp, LOGPROB_FLOOR)}  # the chosen token first, then the N most likely
        for top_lp, top_tok in (top or [])[:n_top]:
            entries.setdefault(token_str(top_tok), max(top_lp, LOGPROB_FLOOR))
        out["top_logprobs"].append(entries)
    return out


def _choice(index: int, c: Completion, req: GenerateRequest, body: CompletionIn, prompt_text: str,
            detok: Detokenizer, eos: int) -> dict:
    def token_str(t: int) -> str:
        return f"token_id:{t}" if body.return_tokens_as_token_ids else detok.token_text(t)

    finish, matched = c.finish_reason, c.finish_reason.get("matched")
    choice = {"index": index, "text": (prompt_text + c.text) if body.echo else c.text, "logprobs": None,
              "finish_reason": "stop" if finish["type"] == "stop" else "length",
              # vLLM: the stop string or stop token id, null for EOS; SGLang: whatever matched
              "stop_reason": None if matched == eos and eos not in req.params.stop_token_ids else matched,
              "matched_stop": matched}
    if body.logprobs is not None:
        tokens, lps = list(c.output_ids), list(c.logprobs)
        tops = list(c.top_logprobs) or [None] * len(tokens)  # empty when logprobs=0 (no alternatives asked)
        if body.echo:  # the prompt's tokens first; its first token has no logprob
            scored = c.input_logprobs
            tokens = list(req.input_ids) + tokens
            lps = [None] + scored.logprobs + lps
            tops = [None] + (scored.top if scored.top is not None else [None] * len(scored.logprobs)) + tops
        choice["logprobs"] = completion_logprobs(tokens, lps, tops, body.logprobs, token_str)
    if body.prompt_logprobs is not None:  # vLLM's layout: per prompt token {id: {logprob, rank, decoded_token}}
        scored = c.input_logprobs
        choice["prompt_logprobs"] = [None] + [
            {str(t): {"logprob": max(lp, LOGPROB_FLOOR), "rank": rank, "decoded_token": token_str(t)}}
            | {str(tt): {"logprob": max(tl, LOGPROB_FLOOR), "rank": k + 1, "decoded_token": token_str(tt)}
               for k, (tl, tt) in enumerate((top or [])[:body.prompt_logprobs]) if tt != t}
            for t, lp, rank, top in zip(req.input_ids[1:], scored.logprobs, scored.ranks,
                                        scored.top or [None] * len(scored.logprobs))]
    if body.return_token_ids:
        choice["token_ids"] = list(c.output_ids)
        choice["prompt_token_ids"] = list(req.input_ids)
    return choice


def register(app: FastAPI, scheduler, detok: Detokenizer, server_info: dict) -> None:
    engine = scheduler.rt.engine
    cfg = engine.cfg
    served_name = server_info.get("served_model_name") or engine.model_path  # vLLM: --model by default

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": served_name, "object": "model", "created": int(time.time()), "owned_by": "nvfp4-reference",
            "root": engine.model_path, "parent": None, "max_model_len": cfg.max_position_embeddings}]}

    @app.post("/v1/completions")
    async def completions(raw: Request):
        try:
            try:
                body = CompletionIn.model_validate(await raw.json())
            except ValidationError as exc:
                problems = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])
                loc = exc.errors()[0]["loc"] if exc.errors() else ()
                raise OpenAIError(f"invalid request: {problems}", param=str(loc[0]) if loc else None) from exc
            except ValueError as exc:
                raise OpenAIError(f"the body is not JSON: {exc}") from exc
            if body.model is not None and body.model != served_name:
                raise OpenAIError(f"The model `{body.model}` does not exist; this server serves `{served_name}`",
                                  status=404, param="model")
            requests, options, prompt_texts = build_requests(body, detok, cfg)
            results = await run_generate(scheduler, requests)
            # stop strings are matched off the event loop (a slow pattern never delays other requests)
            finished = await asyncio.to_thread(lambda: [detok.finish(res, options) for res in results])
        except BadRequest as exc:
            return error_response(exc)
        choices = [_choice(i, c, req, body, text, detok, cfg.eos_token_id)
                   for i, (c, req, text) in enumerate(zip(finished, requests, prompt_texts))]
        prompt_tokens = sum(len(r.input_ids) for r in requests)
        completion_tokens = sum(len(c.output_ids) for c in finished)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": served_name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}
