"""The reference server's OpenAPI document says what it really answers (issue 37): every operation's status codes
(400 for any invalid request, never FastAPI's default 422, which this server does not send; 413 for a body over
the limit; 404 and 503 where an endpoint has them) and the shape of each answer, success and error alike.

FastAPI builds the document from the routes; :func:`install` post-processes it: request bodies of the endpoints
that parse their JSON themselves (``/v1/completions``, ``/collective_rpc``) are described, and every operation's
``responses`` are replaced from :data:`ANSWERS`. The schemas are deliberately open (extra fields allowed): they
state what a client may rely on. ``tests/server/test_server_schema.py`` fuzzes the server from this document
(schemathesis) and checks every answer against it.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi


def _obj(required: dict[str, Any], **optional: Any) -> dict:
    return {"type": "object", "required": sorted(required), "properties": {**required, **optional}}


STR, BOOL, INT, NUM = {"type": "string"}, {"type": "boolean"}, {"type": "integer"}, {"type": "number"}
TEXT = {"text/plain": {"schema": STR}}
NATIVE_ERROR = _obj({"error": STR})
OPENAI_ERROR = _obj({"error": _obj({"message": STR, "type": STR, "code": INT},
                                   param={"type": ["string", "null"]})})
STATUS = _obj({"status": STR})
SUCCESS_MESSAGE = _obj({"success": BOOL, "message": STR})
MODEL_INFO = _obj({"model_path": STR}, tokenizer_path=STR, is_generation=BOOL, weight_version=STR, architecture=STR)
GENERATION = _obj({"text": STR, "output_ids": {"type": "array", "items": INT}, "meta_info": {"type": "object"}})
COMPLETION = _obj({"id": STR, "object": STR, "created": INT, "model": STR,
                   "choices": {"type": "array", "items": _obj({"index": INT, "text": STR},
                                                              finish_reason={"type": ["string", "null"]})},
                   "usage": _obj({"prompt_tokens": INT, "completion_tokens": INT, "total_tokens": INT})})
MODELS = _obj({"object": STR, "data": {"type": "array", "items": _obj({"id": STR}, root=STR)}})
COMPLETION_BODY = {"type": "object", "required": ["prompt"], "properties": {
    "model": {"type": ["string", "null"]},
    "prompt": {"anyOf": [STR, {"type": "array", "items": STR}, {"type": "array", "items": INT},
                         {"type": "array", "items": {"type": "array", "items": INT}}]},
    "max_tokens": {"type": ["integer", "null"]}, "temperature": {"type": ["number", "null"]},
    "top_p": {"type": ["number", "null"]}, "seed": {"type": ["integer", "null"]},
    "logprobs": {"type": ["integer", "null"]}, "echo": BOOL, "ignore_eos": BOOL, "return_token_ids": BOOL,
    "prompt_logprobs": {"type": ["integer", "null"]},
    "stop": {"anyOf": [STR, {"type": "array", "items": STR}, {"type": "null"}]}}}
RPC_BODY = {"type": "object", "required": ["method"], "properties": {
    "method": STR, "kwargs": {"type": "object"}, "args": {"type": "array"}}}


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


#: (method, path) -> (success content, {error status: description}); the error body is the native or the
#: OpenAI error object by path (reference_impl/server/guard.py)
ANSWERS: dict[tuple[str, str], tuple[dict, dict[int, str]]] = {
    ("get", "/health"): (TEXT, {}),
    ("get", "/health_generate"): (TEXT, {}),
    ("get", "/metrics"): (TEXT, {}),
    ("get", "/model_info"): (_json(MODEL_INFO), {}),
    ("get", "/get_model_info"): (_json(MODEL_INFO), {}),
    ("get", "/get_server_info"): (_json(_obj({"model_path": STR})), {}),
    ("post", "/update_weights_from_disk"): (_json(_obj({"success": BOOL, "message": STR})),
                                            {400: "invalid request, or the reload failed (old weights kept)"}),
    ("post", "/release_memory_occupation"): (_json(SUCCESS_MESSAGE), {400: "invalid request or unknown tags"}),
    ("post", "/resume_memory_occupation"): (_json(SUCCESS_MESSAGE), {400: "invalid request or unknown tags"}),
    ("get", "/flush_cache"): ({"text/plain": {"schema": STR}}, {}),
    ("post", "/flush_cache"): ({"text/plain": {"schema": STR}}, {}),
    ("post", "/generate"): (_json({"anyOf": [GENERATION, {"type": "array", "items": GENERATION}]}),
                            {400: "invalid request", 503: "memory released or generation paused: retry later"}),
    ("get", "/v1/models"): (_json(MODELS), {}),
    ("post", "/v1/completions"): (_json(COMPLETION), {400: "invalid request", 404: "another model than the one "
                                                      "served", 503: "memory released or generation paused"}),
    ("post", "/pause"): (_json(STATUS), {400: "unknown mode"}),
    ("post", "/resume"): (_json(STATUS), {}),
    ("get", "/is_paused"): (_json(_obj({"is_paused": BOOL})), {}),
    ("post", "/sleep"): (_json(STATUS), {400: "invalid level or mode"}),
    ("post", "/wake_up"): (_json(STATUS), {400: "unknown tags"}),
    ("get", "/is_sleeping"): (_json(_obj({"is_sleeping": BOOL})), {}),
    ("post", "/reset_prefix_cache"): (_json(_obj({"success": BOOL})), {400: "invalid query parameters"}),
    ("post", "/collective_rpc"): (_json(_obj({"results": {"type": "array"}})),
                                  {400: "invalid request, unknown method, or the reload failed"}),
}
BODIES = {("post", "/v1/completions"): COMPLETION_BODY, ("post", "/collective_rpc"): RPC_BODY}


def _error_schema(path: str, method: str) -> dict:
    if path.startswith("/v1/") or path == "/collective_rpc":
        return OPENAI_ERROR
    if (method, path) == ("post", "/update_weights_from_disk"):  # a failed reload answers its own shape
        return {"anyOf": [NATIVE_ERROR, _obj({"success": BOOL, "message": STR})]}
    return NATIVE_ERROR


def install(app: FastAPI) -> None:
    """Replace ``app.openapi`` with the post-processed document (built once)."""

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path, operations in doc["paths"].items():
            for method, op in operations.items():
                key = (method, path)
                if key not in ANSWERS:
                    raise RuntimeError(f"reference_impl/server/openapi.py: no documented answers for {method.upper()} "
                                       f"{path}: add them to ANSWERS")
                content, errors = ANSWERS[key]
                if key in BODIES:
                    op["requestBody"] = {"required": True, "content": _json(BODIES[key])}
                has_body = "requestBody" in op or any(p.get("in") == "query" for p in op.get("parameters", ()))
                codes = dict(errors)
                if has_body:
                    codes.setdefault(400, "invalid request")
                    codes[413] = "request body over the size limit"
                op["responses"] = {"200": {"description": "success", "content": content}} | {
                    str(code): {"description": why, "content": _json(_error_schema(path, method))}
                    for code, why in sorted(codes.items())}
        schemas = doc.get("components", {}).get("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
