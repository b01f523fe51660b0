"""SGLang's native HTTP API as a server dialect: ``/generate``, ``/update_weights_from_disk``,
``/release_memory_occupation``, ``/resume_memory_occupation``, ``/flush_cache``, ``/get_model_info``."""
from __future__ import annotations

from typing import Sequence

from conformance.interfaces.server import request_work, ReloadResult, SamplingSpec, ServerDialect
from conformance.interfaces.server_types import Generation, TokenGeneration, prompt_logprobs_from


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

    def generate_ids(self, prompts: Sequence[Sequence[int]], spec: SamplingSpec,
                     prompt_logprobs: bool = True) -> list[TokenGeneration]:
        """``input_ids`` with ``return_logprob`` and ``logprob_start_len`` 0 (every prompt position scored)."""
        params = {"max_new_tokens": spec.max_new_tokens, "temperature": spec.temperature, "top_p": spec.top_p,
                  "ignore_eos": spec.ignore_eos}
        body = {"input_ids": [list(p) for p in prompts], "sampling_params": params, "return_logprob": True}
        if prompt_logprobs:
            body["logprob_start_len"] = 0
        data = self._json(self._ok(self._call("POST", "/generate", json=body,
                                                         work=request_work(prompts, spec.max_new_tokens)), "/generate"), "/generate")
        data = data if isinstance(data, list) else [data]
        if len(data) != len(prompts):
            raise AssertionError(f"/generate: {len(data)} answers for {len(prompts)} prompts")
        out = []
        for i, (d, prompt) in enumerate(zip(data, prompts)):
            g = Generation.from_json(d)
            scored, seen = None, tuple(prompt)
            if prompt_logprobs:
                entries = [(e[0], e[1]) for e in (d.get("meta_info", {}).get("input_token_logprobs") or [])]
                scored = prompt_logprobs_from(entries, list(prompt), f"/generate prompt {i} input_token_logprobs")
                seen = tuple(int(e[1]) for e in entries)  # the prompt as the server scored it
            out.append(TokenGeneration(seen, scored, g.ids, g.logprobs or ()))
        return out

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
