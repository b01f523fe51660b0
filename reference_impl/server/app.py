"""HTTP front end of the reference server: SGLang's native endpoints (docs/contracts.md section 6) on FastAPI, plus
the OpenAI-compatible (:mod:`.openai_api`) and vLLM (:mod:`.vllm_api`) endpoints.

Requests are validated here (bounded sizes, clear 4xx errors) and handed to a single scheduler thread that
owns rank 0's runtime: consecutive generate requests are batched together; reloads and memory commands run
between batches, in arrival order, so a generate request sees either the old or the new weights, never a mix.
"""
from __future__ import annotations

import asyncio
import collections
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException  # what FastAPI raises for a body it cannot parse

from reference_impl.server import native_api, openai_api, openapi, vllm_api
from reference_impl.server.api_common import MAX_BATCH, MAX_BODY_BYTES, BadRequest
from reference_impl.server.engine import MEMORY_TAGS
from reference_impl.server.guard import RequestGuard, error_response, internal_error
from reference_impl.server.outputs import Detokenizer


class UpdateWeightsIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model_path: str = Field(..., min_length=1, max_length=4096)
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class MemoryTagsIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tags: list[str] | None = None


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
        self.running = 0  # generate requests in the batch now running (the /metrics gauge)
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
            self.running = len(batch)
            try:
                self.run_generate(batch)
            finally:
                self.running = 0
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


def create_app(scheduler: Scheduler, tokenizer, server_info: dict) -> FastAPI:
    """The reference server's application: error handlers, SGLang's info and control endpoints, the native,
    OpenAI and vLLM APIs, the request guard and the OpenAPI document."""
    app = FastAPI(title="NVFP4 W4A16 reference server")
    _install_error_handlers(app)
    _register_info_routes(app, scheduler, server_info)
    _register_control_routes(app, scheduler)
    detok = Detokenizer(tokenizer, Path(server_info["tokenizer_path"]).parent)
    native_api.register(app, scheduler, detok, scheduler.rt.engine.cfg)  # POST /generate
    openai_api.register(app, scheduler, detok, server_info)  # /v1/models, /v1/completions
    vllm_api.register(app, scheduler, server_info)  # vLLM's sleep / wake-up / reload endpoints
    # outermost: the byte limit on what is read, Unicode, nesting and array bounds (reference_impl/server/guard.py)
    app.add_middleware(RequestGuard, max_bytes=MAX_BODY_BYTES)
    app.add_exception_handler(Exception, internal_error)
    openapi.install(app)  # the document says what the server really answers (reference_impl/server/openapi.py)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    """Refusals in this API's error shape (``{"error": ...}``), FastAPI's own included."""
    @app.exception_handler(BadRequest)
    async def bad_request(_request, exc: BadRequest):
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        # FastAPI's own refusals (a body it cannot parse: "There was an error parsing the body") in this API's
        # error shape, not FastAPI's {"detail": ...}
        return error_response(request.url.path, f"invalid request: {exc.detail}", exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()[:5])
        return JSONResponse({"error": f"invalid request: {problems} (send a JSON body with "
                                      f"content-type: application/json)"}, status_code=400)


def _register_info_routes(app: FastAPI, scheduler: Scheduler, server_info: dict) -> None:
    """Health, the running-request gauges and the model / server information endpoints."""
    engine = scheduler.rt.engine
    cfg = engine.cfg

    @app.get("/health")
    @app.get("/health_generate")
    async def health():
        return PlainTextResponse("")

    @app.get("/metrics")
    async def metrics():
        # the running-request gauges of the engines whose APIs this server speaks (Prometheus text format)
        running, waiting = scheduler.running, len(scheduler.pending_generate_jobs())
        return PlainTextResponse("".join(
            f"# TYPE {name} gauge\n{name} {value}\n" for name, value in (
                ("vllm:num_requests_running", running), ("vllm:num_requests_waiting", waiting),
                ("sglang:num_running_reqs", running), ("sglang:num_queue_reqs", waiting))))

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        return {"model_path": engine.model_path, "tokenizer_path": server_info["tokenizer_path"],
                "is_generation": True, "weight_version": str(engine.weight_version),
                "architecture": cfg.arch, **server_info["parallel"]}

    @app.get("/get_server_info")
    async def server_info_route():
        return {"model_path": engine.model_path, **server_info["parallel"], "device": server_info["device"]}


def _register_control_routes(app: FastAPI, scheduler: Scheduler) -> None:
    """SGLang's control endpoints: reload weights from disk, release / resume memory, flush the cache."""
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
