"""Server dialects: the HTTP API the scenario suite speaks to an engine, one small class per API.

:class:`conformance.interfaces.server.ServerDialect` is the interface (like httpx's ``BaseTransport``): the
operations the scenarios need, in engine-neutral terms. Each built-in API is a plain subclass here:

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

import threading
import time
from typing import Sequence

import requests

from conformance.interfaces.server import (
    MEMORY_TAGS,
    DialectUnsupported,
    ReloadResult,
    SamplingSpec,
    ServerDialect,
)
from conformance.server.client import Deadline, Generation


class SGLangDialect(ServerDialect):
    name = "sglang"

    def model_path(self) -> str:
        return str(self._json(self._ok(self._call("GET", "/get_model_info"), "/get_model_info"),
                              "/get_model_info")["model_path"])

    def generate(self, prompts: Sequence[str], spec: SamplingSpec) -> list[Generation]:
        params = {"max_new_tokens": spec.max_new_tokens, "temperature": spec.temperature, "top_p": spec.top_p,
                  "ignore_eos": spec.ignore_eos}
        if spec.seed is not None:
            params["sampling_seed"] = spec.seed
        r = self._ok(self._call("POST", "/generate", json={"text": list(prompts), "sampling_params": params,
                                                           "return_logprob": True}), "/generate")
        data = self._json(r, "/generate")
        return [Generation.from_json(d) for d in (data if isinstance(data, list) else [data])]

    def reload_weights(self, path: str, flush_cache: bool = True) -> ReloadResult:
        r = self._call("POST", "/update_weights_from_disk",
                       json={"model_path": path, "flush_cache": flush_cache, "abort_all_requests": False})
        data = self._json(r, "/update_weights_from_disk")
        if not isinstance(data, dict) or "success" not in data:
            raise AssertionError(f"/update_weights_from_disk answer has no 'success': {data}")
        return ReloadResult(bool(data["success"]), str(data.get("message", "")))

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        self._ok(self._call("POST", "/release_memory_occupation", json={"tags": list(tags)} if tags else {}),
                 f"/release_memory_occupation {tags}")

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        self._ok(self._call("POST", "/resume_memory_occupation", json={"tags": list(tags)} if tags else {}),
                 f"/resume_memory_occupation {tags}")

    def flush_cache(self) -> None:
        self._ok(self._call("POST", "/flush_cache"), "/flush_cache")


class OpenAIDialect(ServerDialect):
    """``/v1/completions`` with ``logprobs: 0`` (the chosen tokens' logprobs) and ``return_token_ids``."""

    name = "openai"
    health_path = "/v1/models"  # the OpenAI API has no health endpoint
    unsupported = {op: "the OpenAI API has no weight or memory endpoints" for op in
                   ("reload_weights", "release_memory", "resume_memory")} | {
        "flush_cache": "the OpenAI API has no cache endpoint"}

    def __init__(self, base_url: str, deadline: Deadline | None = None, max_request_s: float = 60.0):
        super().__init__(base_url, deadline, max_request_s)
        self._model: dict | None = None

    def _model_card(self) -> dict:
        if self._model is None:
            data = self._json(self._ok(self._call("GET", "/v1/models"), "/v1/models"), "/v1/models")
            cards = data.get("data") if isinstance(data, dict) else None
            if not cards:
                raise AssertionError(f"/v1/models lists no model: {data}")
            self._model = cards[0]
        return self._model

    def model_path(self) -> str:
        card = self._model_card()
        return str(card.get("root") or card["id"])

    def _completion_body(self, prompts: Sequence[str], spec: SamplingSpec) -> dict:
        body = {"model": self._model_card()["id"], "prompt": list(prompts), "max_tokens": spec.max_new_tokens,
                "temperature": spec.temperature, "top_p": spec.top_p, "logprobs": 0,
                "ignore_eos": spec.ignore_eos, "return_token_ids": True}
        if spec.seed is not None:
            body["seed"] = spec.seed
        return body

    def generate(self, prompts: Sequence[str], spec: SamplingSpec) -> list[Generation]:
        r = self._ok(self._call("POST", "/v1/completions", json=self._completion_body(prompts, spec)),
                     "/v1/completions")
        data = self._json(r, "/v1/completions")
        choices = sorted(data.get("choices") or [], key=lambda c: c["index"])
        if len(choices) != len(prompts):
            raise AssertionError(f"/v1/completions: {len(choices)} choices for {len(prompts)} prompts")
        return [self._generation(c) for c in choices]

    def _generation(self, choice: dict) -> Generation:
        ids = choice.get("token_ids")
        if ids is None:
            raise AssertionError("/v1/completions returned no token_ids: the openai dialect needs the "
                                 "return_token_ids extension (vLLM >= 0.10.2, SGLang)")
        lps = (choice.get("logprobs") or {}).get("token_logprobs")
        if lps is None or len(lps) != len(ids):
            raise AssertionError(f"/v1/completions: {0 if lps is None else len(lps)} token_logprobs for "
                                 f"{len(ids)} token_ids")
        prompt_ids = choice.get("prompt_token_ids")  # return_token_ids: the prompt as the server tokenized it
        return Generation(choice["text"], tuple(ids), tuple(float(x) for x in lps), choice.get("finish_reason"),
                          len(prompt_ids) if isinstance(prompt_ids, list) else None)


class VLLMDialect(OpenAIDialect):
    """vLLM's OpenAI API plus its dev-mode weight and memory endpoints.

    A reload is vLLM's documented weight-update sequence: ``/pause?mode=wait`` (in-flight requests finish;
    new ones get 503 "retry"), ``/collective_rpc`` ``reload_weights``, ``/reset_prefix_cache`` (with
    ``flush_cache``), ``/resume``. Generate requests this dialect sends while its own reload holds the
    pause are retried, as vLLM asks of clients, so none is lost. Releasing memory is ``/sleep?level=2``
    (weights discarded, like SGLang's release without CPU backup: reload them after waking); vLLM sleeps as
    a whole, so only releasing everything is possible."""

    name = "vllm"
    health_path = "/health"
    unsupported = {}
    launch_env = {"VLLM_SERVER_DEV_MODE": "1"}  # vLLM serves its weight and memory endpoints only in dev mode
    DEV_PATHS = ("/collective_rpc", "/sleep", "/wake_up", "/is_sleeping", "/pause", "/resume", "/reset_prefix_cache")
    WAKE_TAGS = {"weights": "weights", "kv_cache": "kv_cache"}  # cuda_graph: vLLM keeps or restores graphs itself
    RETRY_S = 0.05

    def __init__(self, base_url: str, deadline: Deadline | None = None, max_request_s: float = 60.0):
        super().__init__(base_url, deadline, max_request_s)
        self._reloading = threading.Event()
        self._reloads_done = 0  # a 503 answered while our reload held the pause may arrive after it ended

    def _call(self, method: str, path: str, **kwargs) -> requests.Response:
        done = self._reloads_done
        r = super()._call(method, path, **kwargs)
        while r.status_code == 503 and path == "/v1/completions" and (
                self._reloading.is_set() or self._reloads_done != done):
            time.sleep(self.RETRY_S)  # refused by our own reload's pause: retry, bounded by the deadline
            done = self._reloads_done
            r = super()._call(method, path, **kwargs)
        if r.status_code == 404 and path in self.DEV_PATHS:
            raise AssertionError(f"{method} {path} answered 404: vLLM serves it only with VLLM_SERVER_DEV_MODE=1 "
                                 f"(vLLM 0.32/0.33 register every dev route with it; --enable-sleep-mode decides "
                                 f"whether /sleep releases GPU memory, not whether the route exists)")
        return r

    def _completion_body(self, prompts: Sequence[str], spec: SamplingSpec) -> dict:
        return super()._completion_body(prompts, spec) | {"return_tokens_as_token_ids": True}

    def restore_serving(self) -> None:
        super().restore_serving()  # /wake_up
        try:
            self._ok(self._call("POST", "/resume"), "/resume")
        except AssertionError:
            pass

    def _generation(self, choice: dict) -> Generation:
        g = super()._generation(choice)
        tokens = choice["logprobs"].get("tokens")
        expected = [f"token_id:{t}" for t in g.ids]
        if tokens != expected:  # the two token-id channels of the answer must agree
            raise AssertionError(f"/v1/completions: logprobs tokens {tokens} != token_ids {list(g.ids)}")
        return g

    def _rpc_reload(self, path: str, flush_cache: bool) -> requests.Response:
        r = self._call("POST", "/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": path}})
        if r.status_code == 200 and flush_cache:
            self.flush_cache()
        return r

    def reload_weights(self, path: str, flush_cache: bool = True) -> ReloadResult:
        sleeping = self._json(self._ok(self._call("GET", "/is_sleeping"), "/is_sleeping"), "/is_sleeping")
        if sleeping.get("is_sleeping"):  # the sleep/wake sequence: nothing is generating, no pause to resume
            r = self._rpc_reload(path, flush_cache)
        else:
            self._reloading.set()
            try:
                self._ok(self._call("POST", "/pause", params={"mode": "wait"}), "/pause?mode=wait")
                try:
                    r = self._rpc_reload(path, flush_cache)
                finally:
                    self._ok(self._call("POST", "/resume"), "/resume")
            finally:
                self._reloads_done += 1
                self._reloading.clear()
        if r.status_code != 200:
            data = self._json(r, "/collective_rpc reload_weights")
            error = data.get("error") if isinstance(data, dict) else None
            message = error.get("message") if isinstance(error, dict) else (error or r.text)
            return ReloadResult(False, f"reload_weights answered {r.status_code}: {message}")
        return ReloadResult(True, f"reload_weights from {path!r}: {r.text[:200]}")

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        if tags is not None and set(tags) != set(MEMORY_TAGS):
            raise DialectUnsupported(self.name, f"release only {list(tags)}",
                                     "vLLM's /sleep releases weights and KV cache together")
        self._ok(self._call("POST", "/sleep", params={"level": 2}), "/sleep?level=2")

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        if tags is None:
            self._ok(self._call("POST", "/wake_up"), "/wake_up")
            return
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if unknown:
            raise ValueError(f"unknown memory tags {unknown}; known: {list(MEMORY_TAGS)}")
        wake = [self.WAKE_TAGS[t] for t in tags if t in self.WAKE_TAGS]
        if wake:
            self._ok(self._call("POST", "/wake_up", params=[("tags", t) for t in wake]), f"/wake_up?tags={wake}")

    def flush_cache(self) -> None:
        for _ in range(5):  # vLLM: success=false while blocks are held; callers may retry
            data = self._json(self._ok(self._call("POST", "/reset_prefix_cache"), "/reset_prefix_cache"),
                              "/reset_prefix_cache")
            if isinstance(data, dict) and data.get("success"):
                return
            time.sleep(0.2)
        raise AssertionError(f"/reset_prefix_cache kept answering {data}")


DIALECTS: dict[str, type[ServerDialect]] = {d.name: d for d in (SGLangDialect, OpenAIDialect, VLLMDialect)}


def make_dialect(name: str, base_url: str, deadline: Deadline | None = None, max_request_s: float = 60.0) -> ServerDialect:
    try:
        cls = DIALECTS[name]
    except KeyError:
        raise ValueError(f"unknown server API {name!r}; known: {sorted(DIALECTS)}") from None
    return cls(base_url, deadline, max_request_s)
