"""What every request to the reference server passes before any endpoint sees it (issue 37): a hostile or
malformed request gets a 4xx naming what is wrong, never a 500, and never holds the server.

:class:`RequestGuard` is a plain ASGI middleware, outermost:

* the body limit counts the bytes actually read, whatever the transfer encoding (a chunked body declares no
  ``Content-Length``): past :data:`~.api_common.MAX_BODY_BYTES` the request is answered 413 and the connection
  closed (the rest of the body is never read);
* a JSON body is parsed once here and must be valid Unicode text throughout (a JSON-escaped lone surrogate such as
  ``"\\ud800"`` decodes to a Python string no tokenizer accepts), nested at most :data:`MAX_DEPTH` levels and hold
  no array longer than :data:`MAX_ITEMS`; a violation is a 400 naming the field (``prompt[0]``, ``kwargs``);
  a body that is not JSON is left to the endpoint, which says so in its own API's error format;
* the body is then replayed to the application unchanged.

:func:`internal_error` is the last resort for a bug: a 500 naming the exception type, with ``Connection: close``
(the server ends the connection after an unhandled error: the header tells the client not to reuse it).
"""
from __future__ import annotations

import json
from typing import Any

from typing import Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse

# ASGI's shapes (FastAPI's own app is one): plain aliases, not a dependency on starlette's typing module
Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_DEPTH = 32  # the deepest a request of any endpoint legitimately nests is 4 (input_ids: [[...]], kwargs)
MAX_ITEMS = 1 << 16  # longest array: a prompt of token ids, one id per item (the model's positions are fewer)


def error_response(path: str, message: str, status: int, param: str | None = None) -> JSONResponse:
    """The error object of the API ``path`` belongs to (OpenAI/vLLM or SGLang's native one)."""
    if path.startswith("/v1/") or path == "/collective_rpc":  # the OpenAI/vLLM error object
        body: Any = {"error": {"message": message, "type": "BadRequestError" if status < 500 else "InternalServerError",
                               "param": param, "code": status}}
    else:  # SGLang's native endpoints
        body = {"error": message}
    headers = {"connection": "close"} if status == 413 or status >= 500 else None
    return JSONResponse(body, status_code=status, headers=headers)


def _field(path: list) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(the body)"


def find_problem(value: Any) -> tuple[str, str] | None:
    """(field, what is wrong) for the first string that is not valid Unicode text, array over MAX_ITEMS, or
    nesting past MAX_DEPTH in a parsed JSON body; None when there is none. Iterative: no recursion limit."""
    stack: list[tuple[Any, list, int]] = [(value, [], 0)]
    while stack:
        v, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            return _field(path), f"nested deeper than {MAX_DEPTH} levels"
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as exc:
                return _field(path), (f"not valid Unicode text: a lone surrogate {v[exc.start]!r} at position "
                                      f"{exc.start} (JSON \\ud800-\\udfff escapes must come in pairs)")
        elif isinstance(v, dict):
            for k, item in v.items():
                if isinstance(k, str):
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError:
                        return _field(path), "a key that is not valid Unicode text (a lone surrogate)"
                stack.append((item, path + [k], depth + 1))
        elif isinstance(v, list):
            if len(v) > MAX_ITEMS:
                return _field(path), f"an array of {len(v)} items, over the {MAX_ITEMS} limit"
            stack.extend((item, path + [i], depth + 1) for i, item in enumerate(v))
    return None


class RequestGuard:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await error_response(path, f"request body over {self.max_bytes} bytes", 413)(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if body:
            try:
                parsed = json.loads(body)
            except RecursionError:
                parsed, problem = None, ("(the body)", f"nested deeper than {MAX_DEPTH} levels")
            except ValueError:  # not JSON (or not UTF-8): the endpoint answers in its own API's format
                parsed, problem = None, None
            else:
                problem = find_problem(parsed)
            if problem is not None:
                field, what = problem
                top = field.split(".")[0].split("[")[0]
                await error_response(path, f"{field}: {what}", 400, None if top.startswith("(") else top)(scope, receive, send)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(request.url.path, f"internal error ({type(exc).__name__}); the server stays up: please report "
                                    f"the request that caused it", 500)
