"""vLLM's server as a dialect: its OpenAI API (:class:`conformance.interfaces.server_openai.OpenAIDialect`) plus its
development-mode endpoints (``VLLM_SERVER_DEV_MODE=1``, ``--enable-sleep-mode``): ``/collective_rpc``
``reload_weights``, ``/pause``, ``/resume``, ``/sleep``, ``/wake_up``, ``/reset_prefix_cache``."""
from __future__ import annotations

import threading
import time
from typing import Sequence

import requests

from conformance.interfaces.server import MEMORY_TAGS, DialectUnsupported, ReloadResult, SamplingSpec
from conformance.interfaces.server_types import Deadline, Generation
from conformance.interfaces.server_openai import OpenAIDialect


class VLLMDialect(OpenAIDialect):
    """vLLM's OpenAI API plus its dev-mode weight and memory endpoints.

    A reload is vLLM's documented weight-update sequence: ``/pause?mode=wait`` (in-flight requests finish;
    new ones get 503 "retry"), ``/collective_rpc`` ``reload_weights``, ``/reset_prefix_cache`` (with
    ``flush_cache``), ``/resume``. Generate requests this dialect sends while its own reload holds the
    pause are retried, as vLLM asks of clients, so none is lost. Releasing memory is ``/sleep?level=2``
    (weights discarded, like SGLang's release without CPU backup: reload them after waking); vLLM sleeps as
    a whole, so only releasing everything is possible."""

    name = "vllm"
    running_gauges = ("vllm:num_requests_running",)
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

    def _prompt_logprob_fields(self, prompt_logprobs: bool) -> dict:
        return {"prompt_logprobs": 0} if prompt_logprobs else {}  # vLLM's extension (not echo)

    def _token_generation(self, choice: dict, prompt: list[int], prompt_logprobs: bool, i: int):
        from conformance.interfaces.server_types import TokenGeneration, prompt_logprobs_from

        g = super()._token_generation(choice, prompt, False, i)
        if not prompt_logprobs:
            return g
        raw = choice.get("prompt_logprobs")
        if not isinstance(raw, list):
            raise AssertionError(f"/v1/completions choice {i}: no prompt_logprobs list (asked with prompt_logprobs=0)")
        entries = []
        for j, pos in enumerate(raw):
            if pos is None:
                entries.append((None, None))
                continue
            own = pos.get(str(prompt[j])) if isinstance(pos, dict) and j < len(prompt) else None
            if not isinstance(own, dict) or "logprob" not in own:
                raise AssertionError(f"/v1/completions choice {i}: prompt_logprobs[{j}] has no entry for the "
                                     f"prompt's token {prompt[j] if j < len(prompt) else '?'}: {str(pos)[:200]}")
            entries.append((own["logprob"], prompt[j]))
        return TokenGeneration(g.prompt_ids, prompt_logprobs_from(entries, prompt, f"choice {i} prompt_logprobs"),
                               g.ids, g.logprobs)

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
