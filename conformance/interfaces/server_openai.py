"""The OpenAI-compatible API as a server dialect: ``/v1/models``, ``/v1/completions`` with logprobs and the
``return_token_ids`` extension vLLM and SGLang share. It has no weight or memory endpoints (those operations
raise :class:`~conformance.interfaces.server.DialectUnsupported`); engines extend it with their own
(:class:`conformance.adapters.vllm.server.VLLMDialect`).

A standard API, not a vendor's: the built-in plain subclass of :class:`~conformance.interfaces.server.ServerDialect`
shipped beside it (as httpx ships its transports beside ``BaseTransport``), so adapters can extend it.
``conformance.server.openai`` re-exports it (the ``openai`` row of the selection table names that path)."""
from __future__ import annotations

from typing import Sequence

from conformance.interfaces.server import request_work, SamplingSpec, ServerDialect
from conformance.interfaces.server_types import Deadline, Generation, TokenGeneration, prompt_logprobs_from


class OpenAIDialect(ServerDialect):
    """``/v1/completions`` with ``logprobs: 0`` (the chosen tokens' logprobs) and ``return_token_ids``."""

    name = "openai"
    generate_paths = ("/v1/completions",)
    running_gauges = ("vllm:num_requests_running", "sglang:num_running_reqs")  # whichever engine serves it
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

    def generate_ids(self, prompts: Sequence[Sequence[int]], spec: SamplingSpec,
                     prompt_logprobs: bool = True) -> list[TokenGeneration]:
        """Token-id prompts; prompt logprobs by ``echo`` with ``logprobs`` (the prompt's tokens first, the first
        one null, then the generated ones)."""
        body = self._completion_body([list(p) for p in prompts], spec) | self._prompt_logprob_fields(prompt_logprobs)
        data = self._json(self._ok(self._call("POST", "/v1/completions", json=body,
                                                         work=request_work(prompts, spec.max_new_tokens)), "/v1/completions"),
                          "/v1/completions")
        choices = sorted(data.get("choices") or [], key=lambda c: c["index"])
        if len(choices) != len(prompts):
            raise AssertionError(f"/v1/completions: {len(choices)} choices for {len(prompts)} prompts")
        return [self._token_generation(c, list(p), prompt_logprobs, i)
                for i, (c, p) in enumerate(zip(choices, prompts))]

    def _prompt_logprob_fields(self, prompt_logprobs: bool) -> dict:
        return {"echo": True} if prompt_logprobs else {}

    def _token_generation(self, choice: dict, prompt: list[int], prompt_logprobs: bool, i: int) -> TokenGeneration:
        ids = choice.get("token_ids")
        lps = (choice.get("logprobs") or {}).get("token_logprobs")
        if ids is None or lps is None:
            raise AssertionError("/v1/completions returned no token_ids or token_logprobs (the openai dialect needs "
                                 "return_token_ids and logprobs)")
        scored = None
        if prompt_logprobs:
            if len(lps) != len(prompt) + len(ids):
                raise AssertionError(f"/v1/completions choice {i}: echo gave {len(lps)} token_logprobs for a "
                                     f"{len(prompt)}-token prompt and {len(ids)} generated tokens")
            scored = prompt_logprobs_from([(lp, None) for lp in lps[:len(prompt)]], prompt,
                                          f"/v1/completions choice {i} echo")
            lps = lps[len(prompt):]
        if len(lps) != len(ids):
            raise AssertionError(f"/v1/completions choice {i}: {len(lps)} token_logprobs for {len(ids)} token_ids")
        seen = choice.get("prompt_token_ids")  # return_token_ids: the prompt as the server saw it
        return TokenGeneration(tuple(seen) if isinstance(seen, list) else tuple(prompt), scored, tuple(ids),
                               tuple(float(x) for x in lps))
