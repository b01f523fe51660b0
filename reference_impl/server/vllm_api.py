"""vLLM's development-mode endpoints for memory and weights (vLLM 0.33.0, served with
``VLLM_SERVER_DEV_MODE=1 vllm serve ... --enable-sleep-mode``), mapped onto the reference engine:

=============================================  ==================================================================
vLLM 0.33.0 (file)                             reference server
=============================================  ==================================================================
``POST /sleep?level=1|2&mode=``                level 1: release weights (kept as a CPU copy), kv_cache, cuda_graph;
(entrypoints/serve/dev/sleep/api_router.py)    level 2: release them, weights discarded (they come back zeroed:
-> ``{"status": "sleeping", "level": L}``      reload them). level 0 (pause scheduling only): 400, the reference has
                                               no scheduler pause. ``mode`` (abort|wait|keep) is accepted; requests
                                               queued before the sleep complete first (as ``wait``)
``POST /wake_up[?tags=weights&tags=kv_cache]`` resume ``weights`` / ``kv_cache`` (+ ``cuda_graph``, which vLLM
-> ``{"status": "awake"|"sleeping", "tags"}``  keeps resident or restores with any wake); all when no tags
``GET /is_sleeping`` -> ``{"is_sleeping"}``    true while anything is released
``POST /reset_prefix_cache`` -> ``{"success"}`` flush_cache (the reference has no prefix cache; always succeeds)
(entrypoints/serve/dev/cache/api_router.py)
``POST /collective_rpc``                       only ``{"method": "reload_weights", "kwargs": {"weights_path": P}}``
(entrypoints/serve/dev/rpc/api_router.py;      (``weights_path`` omitted: the checkpoint being served): the
worker: v1/worker/gpu_worker.py                reference's atomic reload. ``{"results": [null, ...]}`` (one per
``reload_weights`` -> model_loader/reload/     rank) on success; on failure a 400 error and the old weights keep
inplace.py)                                    serving (vLLM's in-place reload is not atomic)
=============================================  ==================================================================

While asleep, generation answers 503 (as SGLang while released). vLLM 0.33.0 instead holds new requests in
its paused scheduler until it is fully awake; older vLLM answered 503 on the protected endpoints.
"""
from __future__ import annotations

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse

from .api_common import BadRequest

VLLM_SLEEP_TAGS = ("weights", "kv_cache")  # vllm/v1/executor/abstract.py SLEEP_TAGS
REFERENCE_TAGS = {"weights": ["weights"], "kv_cache": ["kv_cache", "cuda_graph"]}
PAUSE_MODES = ("abort", "wait", "keep")
RPC_METHODS = ("reload_weights",)


def vllm_error(message: str, status: int = 400, param: str | None = None) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


def register(app: FastAPI, scheduler, server_info: dict) -> None:
    engine = scheduler.rt.engine
    ranks = int(server_info["parallel"].get("tp_size", 1))

    async def command(kind: str, arg):
        out = await scheduler.submit(kind, arg)
        if isinstance(out, BaseException):  # an EngineError returned by the rank
            raise BadRequest(str(out))
        return out

    @app.post("/sleep")
    async def sleep(level: int = Query(1, ge=0, le=2), mode: str = Query("abort")):
        if mode not in PAUSE_MODES:
            return vllm_error(f"mode={mode!r}: supported {list(PAUSE_MODES)}", param="mode")
        if level == 0:
            return vllm_error("sleep level 0 (pause scheduling, keep memory) is not supported by the reference "
                              "server: it has no scheduler pause; supported levels: 1 (offload weights), "
                              "2 (discard weights)", param="level")
        await command("offload" if level == 1 else "release", None)
        return {"status": "sleeping", "level": level}

    @app.post("/wake_up")
    async def wake_up(raw: Request):
        tags = raw.query_params.getlist("tags") or None
        unknown = [t for t in tags or () if t not in VLLM_SLEEP_TAGS]
        if unknown:
            return vllm_error(f"unknown wake_up tags {unknown}; vLLM's tags: {list(VLLM_SLEEP_TAGS)}", param="tags")
        await command("resume", None if tags is None else [r for t in tags for r in REFERENCE_TAGS[t]])
        return {"status": "sleeping" if engine.released else "awake", "tags": tags}

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": bool(engine.released)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = False, reset_external: bool = False):
        await scheduler.submit("flush", None)
        return {"success": True}

    @app.post("/collective_rpc")
    async def collective_rpc(raw: Request):
        try:
            body = await raw.json()
        except ValueError as exc:
            return vllm_error(f"JSON decode error: {exc}")
        if not isinstance(body, dict):
            return vllm_error("Request body must be a JSON object")
        method = body.get("method")
        if method is None:
            return vllm_error("Missing 'method' in request body", param="method")
        if method not in RPC_METHODS:
            return vllm_error(f"method {method!r} is not available on the reference server; supported: "
                              f"{list(RPC_METHODS)}", param="method")
        kwargs, args = body.get("kwargs") or {}, body.get("args") or []
        extra = sorted(set(kwargs) - {"weights_path", "is_checkpoint_format"})
        if args or extra or kwargs.get("is_checkpoint_format", True) is not True:
            return vllm_error("reload_weights on the reference server takes kwargs weights_path (a checkpoint "
                              "directory; default: the one being served) and is_checkpoint_format=true only; "
                              f"got args={args!r}, kwargs={kwargs!r}", param="kwargs")
        path = kwargs.get("weights_path") or engine.model_path
        if not isinstance(path, str):
            return vllm_error(f"weights_path must be a string, got {path!r}", param="kwargs")
        ok, message = await scheduler.submit("update", path)
        if not ok:
            return vllm_error(message)
        return {"results": [None] * ranks}
