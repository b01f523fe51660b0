"""HTTP front end of the reference server: SGLang's native endpoints (SPEC.md section 6) on FastAPI.

Requests are validated here (bounded sizes, clear 4xx errors) and handed to a single scheduler thread that
owns rank 0's runtime: consecutive generate requests are batched together; reloads and memory commands run
between batches, in arrival order, so a generate request sees either the old or the new weights, never a mix.
"""
from __future__ import annotations

import asyncio
import collections
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from .engine import MEMORY_TAGS, EngineError, GenerateRequest, SamplingParams

MAX_BODY_BYTES = 1 << 20
MAX_BATCH = 64
MAX_NEW_TOKENS = 256


class SamplingParamsIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_new_tokens: int = Field(16, ge=0, le=MAX_NEW_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=0.0)  # accepted for compatibility; only 0 is supported
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    sampling_seed: int | None = Field(None, ge=0, le=2**63 - 1)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=64)


class GenerateIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsIn | list[SamplingParamsIn] | None = None
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(0, ge=0, le=0)
    stream: bool = Field(False, description="streaming is not supported")
    rid: str | list[str] | None = None


class UpdateWeightsIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model_path: str = Field(..., min_length=1, max_length=4096)
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class MemoryTagsIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tags: list[str] | None = None


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class _Job:
    kind: str
    arg: Any
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop

    def resolve(self, value) -> None:
        def _set():
            if not self.future.done():
                if isinstance(value, BaseException):
                    self.future.set_exception(value)
                else:
                    self.future.set_result(value)
        self.loop.call_soon_threadsafe(_set)


class Scheduler:
    """Owns rank 0's runtime; a single thread runs commands in arrival order, batching generates."""

    def __init__(self, runtime):
        self.rt = runtime
        self._jobs: collections.deque[_Job] = collections.deque()
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)
        self._thread.start()

    async def submit(self, kind: str, arg: Any):
        loop = asyncio.get_running_loop()
        job = _Job(kind, arg, loop.create_future(), loop)
        with self._cv:
            self._jobs.append(job)
            self._cv.notify()
        return await job.future

    def _next_batch(self) -> list[_Job]:
        with self._cv:
            while not self._jobs and not self._stop:
                self._cv.wait()
            if self._stop:
                return []
            first = self._jobs.popleft()
            batch = [first]
            if first.kind == "generate":
                n = len(first.arg)
                while self._jobs and self._jobs[0].kind == "generate" and n + len(self._jobs[0].arg) <= MAX_BATCH:
                    job = self._jobs.popleft()
                    n += len(job.arg)
                    batch.append(job)
            return batch

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if not batch:
                return
            try:
                self.run_batch(batch)
            except BaseException as exc:  # noqa: BLE001 - report, keep serving
                for job in batch:
                    job.resolve(exc)

    def run_batch(self, batch: list[_Job]) -> None:
        if batch[0].kind == "generate":
            self.run_generate(batch)
            return
        job = batch[0]
        job.resolve(self.command((job.kind, job.arg)))

    def run_generate(self, batch: list[_Job]) -> None:
        requests = [r for job in batch for r in job.arg]
        out = self.command(("generate", requests))
        if isinstance(out, BaseException):
            for job in batch:
                job.resolve(out)
            return
        start = 0
        for job in batch:
            job.resolve([out[i] for i in range(start, start + len(job.arg))])
            start += len(job.arg)

    def command(self, cmd: tuple):
        cmd = self.rt.broadcast(cmd)
        return self.rt.execute(cmd)

    def pending_generate_jobs(self) -> list[_Job]:
        with self._cv:
            return [j for j in self._jobs if j.kind == "generate"]

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=10)
        self.rt.broadcast(("shutdown", None))


def _normalise_generate(body: GenerateIn, tokenizer, cfg) -> tuple[list[GenerateRequest], list[int], bool]:
    if (body.text is None) == (body.input_ids is None):
        raise BadRequest("exactly one of 'text' and 'input_ids' is required")
    if body.stream:
        raise BadRequest("streaming is not supported by the reference server")
    if body.text is not None:
        batched = isinstance(body.text, list)
        texts = body.text if batched else [body.text]
        if any(len(t) > 16384 for t in texts):
            raise BadRequest("text longer than 16384 characters")
        ids = [tokenizer.encode(t).ids for t in texts]
    else:
        batched = bool(body.input_ids) and isinstance(body.input_ids[0], list)
        ids = body.input_ids if batched else [body.input_ids]
    if not ids or len(ids) > MAX_BATCH:
        raise BadRequest(f"a request holds 1 to {MAX_BATCH} prompts, got {len(ids)}")
    params = body.sampling_params
    if isinstance(params, list):
        if len(params) != len(ids):
            raise BadRequest(f"{len(params)} sampling_params for {len(ids)} prompts")
    else:
        params = [params or SamplingParamsIn()] * len(ids)
    requests = []
    for seq, p in zip(ids, params):
        if not seq:
            raise BadRequest("empty prompt")
        bad = [t for t in seq if not 0 <= t < cfg.vocab_size]
        if bad:
            raise BadRequest(f"token id {bad[0]} out of range [0, {cfg.vocab_size})")
        if len(seq) + p.max_new_tokens > cfg_max_len(cfg):
            raise BadRequest(f"prompt ({len(seq)} tokens) + max_new_tokens ({p.max_new_tokens}) exceeds the "
                             f"context length {cfg_max_len(cfg)}")
        seed = p.sampling_seed if p.sampling_seed is not None else p.seed
        requests.append(GenerateRequest(tuple(seq), SamplingParams(
            p.max_new_tokens, p.temperature, p.top_p, p.top_k, seed, p.ignore_eos, tuple(p.stop_token_ids or ()))))
    return requests, [len(s) for s in ids], batched


def decode_ids(tokenizer, ids: list[int]) -> str:
    """Text of ``ids``. An id the tokenizer does not have (a tokenizer smaller than the model's vocabulary)
    is written as ``<|token_id=N|>``: it is never silently dropped (``tokenizers`` would drop it)."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if all(0 <= t < size for t in ids):
        return tokenizer.decode(ids)
    parts, run = [], []
    for t in ids:
        if 0 <= t < size:
            run.append(t)
            continue
        if run:
            parts.append(tokenizer.decode(run))
            run = []
        parts.append(f"<|token_id={t}|>")
    if run:
        parts.append(tokenizer.decode(run))
    return "".join(parts)


def cfg_max_len(cfg) -> int:
    return cfg.max_position_embeddings


def create_app(scheduler: Scheduler, tokenizer, server_info: dict) -> FastAPI:
    app = FastAPI(title="NVFP4 W4A16 reference server")
    engine = scheduler.rt.engine
    cfg = engine.cfg

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            return JSONResponse({"error": f"request body over {MAX_BODY_BYTES} bytes"}, status_code=413)
        return await call_next(request)

    @app.exception_handler(BadRequest)
    async def bad_request(_request, exc: BadRequest):
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()[:5])
        return JSONResponse({"error": f"invalid request: {problems} (send a JSON body with "
                                      f"content-type: application/json)"}, status_code=400)

    @app.get("/health")
    @app.get("/health_generate")
    async def health():
        return PlainTextResponse("")

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        return {"model_path": engine.model_path, "tokenizer_path": server_info["tokenizer_path"],
                "is_generation": True, "weight_version": str(engine.weight_version),
                "architecture": cfg.arch, **server_info["parallel"]}

    @app.get("/get_server_info")
    async def server_info_route():
        return {"model_path": engine.model_path, **server_info["parallel"], "device": server_info["device"]}

    @app.post("/generate")
    async def generate(body: GenerateIn):
        requests, prompt_lens, batched = _normalise_generate(body, tokenizer, cfg)
        try:
            out = await scheduler.submit("generate", requests)
        except EngineError as exc:
            raise BadRequest(str(exc), status=503) from exc
        responses = []
        for res, plen in zip(out, prompt_lens):
            meta = {"id": uuid.uuid4().hex, "finish_reason": res.finish_reason, "prompt_tokens": plen,
                    "completion_tokens": len(res.output_ids), "cached_tokens": 0,
                    "weight_version": str(engine.weight_version)}
            if body.return_logprob:
                meta["output_token_logprobs"] = [
                    [lp, tok, decode_ids(tokenizer, [tok]) if body.return_text_in_logprobs else None]
                    for lp, tok in zip(res.logprobs, res.output_ids)]
            responses.append({"text": decode_ids(tokenizer, res.output_ids), "output_ids": res.output_ids,
                              "meta_info": meta})
        return responses if batched else responses[0]

    @app.post("/update_weights_from_disk")
    async def update_weights(body: UpdateWeightsIn):
        ok, message = await scheduler.submit("update", body.model_path)
        return JSONResponse({"success": ok, "message": message, "num_paused_requests": 0},
                            status_code=200 if ok else 400)

    async def _memory(kind: str, body: MemoryTagsIn | None):
        tags = body.tags if body else None
        unknown = [t for t in tags or [] if t not in MEMORY_TAGS]
        if unknown:
            raise BadRequest(f"unknown memory tags {unknown}; known: {list(MEMORY_TAGS)}")
        out = await scheduler.submit(kind, tags)
        if isinstance(out, BaseException):  # an EngineError returned by the rank
            raise BadRequest(str(out))
        return JSONResponse({"success": True, "message": f"{kind} {tags or list(MEMORY_TAGS)}"})

    @app.post("/release_memory_occupation")
    async def release(body: MemoryTagsIn | None = None):
        return await _memory("release", body)

    @app.post("/resume_memory_occupation")
    async def resume(body: MemoryTagsIn | None = None):
        return await _memory("resume", body)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        await scheduler.submit("flush", None)
        return PlainTextResponse("Cache flushed.\n")

    return app
