"""A small synchronous client for SGLang's native HTTP API with a per-scenario deadline.

Every call is bounded: its timeout is the smaller of ``max_request_s`` and the time left on the scenario's
deadline; when the deadline has passed the call fails with an AssertionError naming the scenario.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from urllib.parse import urlparse

import requests

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


class Deadline:
    def __init__(self, seconds: float, what: str):
        self.end, self.seconds, self.what = time.monotonic() + seconds, seconds, what

    def remaining(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{self.what}: exceeded its time limit of {self.seconds:.0f} s")
        return left


@dataclass(frozen=True)
class Generation:
    """One generated sequence: text, token ids, per-token logprobs (None when not requested), and the
    prompt length the server reports (``meta_info.prompt_tokens``; None when it does not)."""

    text: str
    ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    finish_reason: object = None
    prompt_tokens: int | None = None

    @classmethod
    def from_json(cls, d: dict) -> "Generation":
        meta = d.get("meta_info", {})
        lps = meta.get("output_token_logprobs")
        ids = d.get("output_ids")
        if ids is None and lps is not None:
            ids = [e[1] for e in lps]
        if lps is not None:
            if [e[1] for e in lps] != list(ids):
                raise AssertionError(f"output_token_logprobs token ids {[e[1] for e in lps]} != output_ids {ids}")
            lps = tuple(float(e[0]) for e in lps)
        prompt_tokens = meta.get("prompt_tokens")
        return cls(d["text"], tuple(ids or ()), lps, meta.get("finish_reason"),
                   int(prompt_tokens) if isinstance(prompt_tokens, int) else None)


class ServerClient:
    def __init__(self, base_url: str, deadline: Deadline | None = None, max_request_s: float = 60.0):
        host = urlparse(base_url).hostname
        if host not in LOCAL_HOSTS:
            raise ValueError(f"server scenarios only talk to a local server (127.0.0.1), got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.deadline = deadline
        self.max_request_s = max_request_s
        self._http = requests.Session()
        self._http.trust_env = False  # never through a proxy: the server is local

    def with_deadline(self, deadline: Deadline) -> "ServerClient":
        return ServerClient(self.base_url, deadline, self.max_request_s)

    def close(self) -> None:
        self._http.close()

    def _timeout(self) -> float:
        left = self.deadline.remaining() if self.deadline else self.max_request_s
        return max(0.1, min(left, self.max_request_s))

    def _post(self, path: str, body: dict | None = None) -> requests.Response:
        try:
            return self._http.post(self.base_url + path, json=body if body is not None else {}, timeout=self._timeout())
        except requests.Timeout as exc:
            raise AssertionError(f"POST {path} timed out (request lost or server hung)") from exc
        except requests.ConnectionError as exc:
            raise AssertionError(f"POST {path}: connection failed (server gone?): {exc}") from exc

    def _get(self, path: str) -> requests.Response:
        try:
            return self._http.get(self.base_url + path, timeout=self._timeout())
        except requests.Timeout as exc:
            raise AssertionError(f"GET {path} timed out") from exc
        except requests.ConnectionError as exc:
            raise AssertionError(f"GET {path}: connection failed (server gone?): {exc}") from exc

    # ------------------------------------------------------------------ endpoints
    def healthy(self) -> bool:
        try:
            return self._http.get(self.base_url + "/health", timeout=2.0).status_code == 200
        except requests.RequestException:
            return False

    def model_info(self) -> dict:
        r = self._get("/get_model_info")
        r.raise_for_status()
        return r.json()

    def generate_raw(self, body: dict) -> requests.Response:
        return self._post("/generate", body)

    def generate(self, prompts: list[str] | str, sampling_params: dict, return_logprob: bool = True) -> list[Generation]:
        """Generate for one prompt or a batch (one HTTP request either way); always returns a list."""
        r = self._post("/generate", {"text": prompts, "sampling_params": sampling_params,
                                     "return_logprob": return_logprob})
        if r.status_code != 200:
            raise AssertionError(f"/generate answered {r.status_code}: {r.text[:300]}")
        data = r.json()
        items = data if isinstance(data, list) else [data]
        return [Generation.from_json(d) for d in items]

    def update_weights_from_disk(self, model_path: str, flush_cache: bool = True) -> tuple[bool, str]:
        r = self._post("/update_weights_from_disk", {"model_path": model_path, "flush_cache": flush_cache,
                                                     "abort_all_requests": False})
        try:
            data = r.json()
        except ValueError as exc:
            raise AssertionError(f"/update_weights_from_disk answered {r.status_code} without JSON: {r.text[:200]}") from exc
        if "success" not in data:
            raise AssertionError(f"/update_weights_from_disk answer has no 'success': {data}")
        return bool(data["success"]), str(data.get("message", ""))

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        r = self._post("/release_memory_occupation", {"tags": tags} if tags else {})
        if r.status_code != 200:
            raise AssertionError(f"/release_memory_occupation {tags} answered {r.status_code}: {r.text[:200]}")

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        r = self._post("/resume_memory_occupation", {"tags": tags} if tags else {})
        if r.status_code != 200:
            raise AssertionError(f"/resume_memory_occupation {tags} answered {r.status_code}: {r.text[:200]}")

    def flush_cache(self) -> None:
        r = self._post("/flush_cache")
        if r.status_code != 200:
            raise AssertionError(f"/flush_cache answered {r.status_code}: {r.text[:200]}")
