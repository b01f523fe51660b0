"""Server dialects: the HTTP API the scenario suite speaks to an engine, one small class per API.

:class:`conformance.interfaces.server.ServerDialect` is the interface (like httpx's ``BaseTransport``): the
operations the scenarios need, in engine-neutral terms. Each built-in API is a plain subclass, in its
vendor's folder (the standard OpenAI API beside the interface, in ``conformance/interfaces/server_openai.py``),
one row each in the selection table (``conformance/_framework/selection.py``):

* :class:`SGLangDialect`: SGLang's native endpoints (``/generate``, ``/update_weights_from_disk``,
  ``/release_memory_occupation``, ``/resume_memory_occupation``, ``/flush_cache``).
* :class:`OpenAIDialect`: the OpenAI-compatible API (``/v1/models``, ``/v1/completions`` with logprobs and
  the ``return_token_ids`` extension vLLM and SGLang share). It has no weight or memory endpoints.
* :class:`VLLMDialect`: vLLM 0.33.0's OpenAI API plus its development-mode endpoints
  (``VLLM_SERVER_DEV_MODE=1``, ``--enable-sleep-mode``): ``/collective_rpc`` ``reload_weights``,
  ``/sleep``, ``/wake_up``, ``/reset_prefix_cache``.

An operation a dialect lacks raises :class:`DialectUnsupported` carrying the reason, so a scenario that
needs it can skip with that reason (``unsupported`` lists them up front). A server that answers wrongly
raises ``AssertionError`` naming the endpoint and the answer, as the rest of the scenario suite does.
"""
from __future__ import annotations

from conformance._framework import selection
from conformance.interfaces.server import (  # noqa: F401 - the names this module offered since 0.1
    MEMORY_TAGS,
    DialectUnsupported,
    ReloadResult,
    SamplingSpec,
    ServerDialect,
)
from conformance.interfaces.server_types import Deadline


def _dialects() -> dict[str, type[ServerDialect]]:
    out = {}
    for name in selection.names_for("server"):
        cls = selection.import_target(selection.target_of(name, "server"))
        if not (isinstance(cls, type) and issubclass(cls, ServerDialect)):
            raise selection.SelectionError(f"{name}: {cls!r} is not a ServerDialect subclass")
        out[cls.name] = cls
    return out


#: API name -> dialect class, from the selection table's ``server`` column
DIALECTS: dict[str, type[ServerDialect]] = _dialects()
SGLangDialect, OpenAIDialect, VLLMDialect = DIALECTS["sglang"], DIALECTS["openai"], DIALECTS["vllm"]


def dialect_class(name: str) -> type[ServerDialect]:
    """The dialect ``name`` selects: a built-in API name or ``module:attr`` naming a :class:`ServerDialect`
    subclass (:class:`ValueError` naming the known APIs otherwise)."""
    if name in DIALECTS:
        return DIALECTS[name]
    if ":" not in name:
        raise ValueError(f"unknown server API {name!r}; known: {sorted(DIALECTS)}, or module:attr")
    try:
        cls = selection.import_target(name)
    except selection.SelectionError as exc:
        raise ValueError(f"server API {name!r}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, ServerDialect)):
        raise ValueError(f"server API {name!r} is {cls!r}, not a conformance.interfaces.server.ServerDialect subclass")
    return cls


def make_dialect(name: str, base_url: str, deadline: Deadline | None = None, max_request_s: float = 60.0) -> ServerDialect:
    return dialect_class(name)(base_url, deadline, max_request_s)
