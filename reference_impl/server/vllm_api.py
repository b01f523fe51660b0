"""vLLM's development-mode endpoints for memory, weights and pausing (vLLM 0.33.0 served with
``VLLM_SERVER_DEV_MODE=1 vllm serve ... --enable-sleep-mode``), mapped onto the reference engine. Sources:
vllm/entrypoints/serve/dev/{sleep,cache,rpc}/api_router.py, vllm/entrypoints/rl/online/api_router.py,
vllm/v1/engine/core.py (sleep / wake_up), vllm/v1/worker/gpu_worker.py and
vllm/model_executor/model_loader/reload/inplace.py (reload_weights).

* ``POST /pause?mode=abort|wait|keep`` -> ``{"status": "paused"}``; ``POST /resume`` -> ``{"status":
  "resumed"}``; ``GET /is_paused`` -> ``{"is_paused"}``. While paused, new generate requests get 503
  (modes abort and wait) or are held until resumed (keep), as in vLLM. Requests already queued finish first:
  the reference cannot abort (abort behaves as wait) nor freeze a request mid-generation (keep lets them
  finish).
* ``POST /sleep?level=0|1|2&mode=`` -> ``{"status": "sleeping", "level"}``: pauses as ``/pause`` does, then
  level 1 releases weights (kept as a CPU copy, restored on wake-up), kv_cache and cuda_graph; level 2
  releases them with the weights discarded (they come back zeroed: reload them); level 0 releases nothing.
* ``POST /wake_up[?tags=weights&tags=kv_cache&tags=scheduling]`` -> ``{"status": "awake"|"sleeping",
  "tags"}``: resumes ``weights`` / ``kv_cache`` (with ``cuda_graph``, which vLLM keeps resident or restores
  with any wake); all when no tags. Generation resumes once nothing is released (vLLM: "fully awake").
* ``GET /is_sleeping`` -> ``{"is_sleeping"}``: paused or anything released (vLLM's engine core likewise).
* ``POST /reset_prefix_cache`` -> ``{"success": true}``: the reference has no prefix cache (flush).
* ``POST /collective_rpc`` with ``{"method": "reload_weights", "kwargs": {"weights_path": P}}``
  (``weights_path`` omitted: the checkpoint being served) -> ``{"results": [null, ...]}`` (one per rank):
  the reference's atomic reload. On failure a 400 error and the old weights keep serving (vLLM's in-place
  reload is not atomic). Other methods are refused: the reference runs no arbitrary worker methods.
"""
from __future__ import annotations

import asyncio

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse

from reference_impl.server.api_common import BadRequest

VLLM_SLEEP_TAGS = ("weights", "kv_cache")  # vllm/v1/executor/abstract.py SLEEP_TAGS
REFERENCE_TAGS = {"weights": ["weights"], "kv_cache": ["kv_cache", "cuda_graph"]}
PAUSE_MODES = ("abort", "wait", "keep")
RPC_METHODS = ("reload_weights",)
GENERATION_PATHS = ("/generate", "/v1/completions")


class PauseState:
    """vLLM's scheduler pause: ``mode`` None when running."""

    def __init__(self):
        self.mode: str | None = None
        self.resumed = asyncio.Event()
        self.resumed.set()

    def pause(self, mode: str) -> None:
        self.mode = mode
        self.resumed.clear()

    def resume(self) -> None:
        self.mode = None
        self.resumed.set()


def vllm_error(message: str, status: int = 400, param: str | None = None) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(status, "InternalServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


def register(app: FastAPI, scheduler, server_info: dict) -> None:
    """vLLM's development-mode endpoints on ``app`` (see the module docstring): pausing, sleep and wake-up,
    and ``reload_weights`` through ``/collective_rpc``."""
    paused = PauseState()
    pause = _register_pause(app, scheduler, paused)
    _register_sleep(app, scheduler, paused, pause)
    _register_rpc(app, scheduler, int(server_info["parallel"].get("tp_size", 1)))


def _register_pause(app: FastAPI, scheduler, paused: PauseState):
    """``/pause``, ``/resume``, ``/is_paused`` and the middleware holding generation while paused; returns the
    coroutine function that pauses (``/sleep`` pauses too)."""
    @app.middleware("http")
    async def hold_while_paused(request: Request, call_next):
        if paused.mode is not None and request.method == "POST" and request.url.path in GENERATION_PATHS:
            if paused.mode != "keep":
                return vllm_error("generation is paused (POST /resume or /wake_up); retry later", 503)
            await paused.resumed.wait()
        return await call_next(request)

    async def pause(mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode={mode!r}: supported {list(PAUSE_MODES)}")
        paused.pause(mode)
        await scheduler.submit("flush", None)  # runs after the generate requests already queued: drained

    @app.post("/pause")
    async def pause_generation(mode: str = Query("abort"), clear_cache: bool = Query(True)):
        await pause(mode)
        return {"status": "paused"}

    @app.post("/resume")
    async def resume_generation():
        paused.resume()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": paused.mode is not None}

    return pause


def _register_sleep(app: FastAPI, scheduler, paused: PauseState, pause) -> None:
    """``/sleep``, ``/wake_up``, ``/is_sleeping`` and ``/reset_prefix_cache``."""
    engine = scheduler.rt.engine

    async def command(kind: str, arg):
        out = await scheduler.submit(kind, arg)
        if isinstance(out, BaseException):  # an EngineError returned by the rank
            raise BadRequest(str(out))
        return out

    @app.post("/sleep")
    async def sleep(level: int = Query(1, ge=0, le=2), mode: str = Query("abort")):
        await pause(mode)
        if level >= 1:
            await command("offload" if level == 1 else "release", None)
        return {"status": "sleeping", "level": level}

    @app.post("/wake_up")
    async def wake_up(raw: Request):
        tags = raw.query_params.getlist("tags") or None
        unknown = [t for t in tags or () if t not in VLLM_SLEEP_TAGS + ("scheduling",)]
        if unknown:
            return vllm_error(f"unknown wake_up tags {unknown}; vLLM's tags: {list(VLLM_SLEEP_TAGS)} "
                              f"and 'scheduling'", param="tags")
        memory = None if tags is None else [r for t in tags for r in REFERENCE_TAGS.get(t, ())]
        if memory is None or memory:
            await command("resume", memory)
        if not engine.released:
            paused.resume()
        return {"status": "sleeping" if engine.released else "awake", "tags": tags}

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": bool(engine.released) or paused.mode is not None}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = False, reset_external: bool = False):
        await scheduler.submit("flush", None)
        return {"success": True}


def _register_rpc(app: FastAPI, scheduler, ranks: int) -> None:
    """``/collective_rpc``: ``reload_weights`` only, one ``null`` result per rank."""
    engine = scheduler.rt.engine

    @app.post("/collective_rpc")
    async def collective_rpc(raw: Request):
        try:
            body = await raw.json()
        except ValueError as exc:
            return vllm_error(f"JSON decode error: {exc}")
        path = _reload_weights_path(body, engine.model_path)
        if isinstance(path, JSONResponse):
            return path
        ok, message = await scheduler.submit("update", path)
        if not ok:
            return vllm_error(message)
        return {"results": [None] * ranks}


def _reload_weights_path(body, default_path: str) -> str | JSONResponse:
    """The checkpoint a ``/collective_rpc`` body asks ``reload_weights`` to load, or the 400 error refusing it
    (not a JSON object, no method or another one, arguments other than ``weights_path`` and
    ``is_checkpoint_format=true``)."""
    if not isinstance(body, dict):
        return vllm_error("Request body must be a JSON object")
    method = body.get("method")
    if method is None:
        return vllm_error("Missing 'method' in request body", param="method")
    if method not in RPC_METHODS:
        return vllm_error(f"method {method!r} is not available on the reference server; supported: "
                          f"{list(RPC_METHODS)}", param="method")
    kwargs, args = body.get("kwargs") or {}, body.get("args") or []
    if not isinstance(kwargs, dict):
        return vllm_error(f"kwargs must be a JSON object of keyword arguments, got {type(kwargs).__name__} "
                          f"{str(kwargs)[:80]}", param="kwargs")
    if not isinstance(args, list):
        return vllm_error(f"args must be a JSON array, got {type(args).__name__}", param="args")
    extra = sorted(set(kwargs) - {"weights_path", "is_checkpoint_format"})
    if args or extra or kwargs.get("is_checkpoint_format", True) is not True:
        return vllm_error("reload_weights on the reference server takes kwargs weights_path (a checkpoint "
                          "directory; default: the one being served) and is_checkpoint_format=true only; "
                          f"got args={args!r}, kwargs={kwargs!r}", param="kwargs")
    path = kwargs.get("weights_path") or default_path
    if not isinstance(path, str):
        return vllm_error(f"weights_path must be a string, got {path!r}", param="kwargs")
    return path
