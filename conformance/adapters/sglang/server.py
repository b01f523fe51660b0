"""SGLang's native HTTP API as a server dialect: ``/generate``, ``/update_weights_from_disk``,
``/release_memory_occupation``, ``/resume_memory_occupation``, ``/flush_cache``, ``/get_model_info``."""
from __future__ import annotations

from typing import Sequence

from conformance.interfaces.server import ReloadResult, SamplingSpec, ServerDialect
from conformance.interfaces.server_types import Generation


class SGLangDialect(ServerDialect):
    name = "sglang"
    generate_paths = ("/generate",)
    running_gauges = ("sglang:num_running_reqs",)  # with --enable-metrics

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
