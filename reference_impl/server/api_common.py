"""Pieces every HTTP dialect of the reference server shares: request limits, the 4xx exception, and
submitting a generate batch to the scheduler."""
from __future__ import annotations

from reference_impl.server.engine import EngineError, GenerateRequest, GenerateResult

MAX_BODY_BYTES = 1 << 20
MAX_BATCH = 64
MAX_NEW_TOKENS = 256
MAX_STOP_STRINGS = 32  # SGLang 0.5.23 sampling_params.MAX_STOP_COUNT
MAX_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs; OpenAI documents at most 5


class BadRequest(Exception):
    """A request the server refuses, answered with ``status`` and the message (never a 500)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


async def run_generate(scheduler, requests: list[GenerateRequest]) -> list[GenerateResult]:
    """Submit one batch; a state the engine refuses (memory released) is a 503 with its reason."""
    try:
        return await scheduler.submit("generate", requests)
    except EngineError as exc:
        raise BadRequest(str(exc), status=503) from exc


def check_prompt(ids: list[int], vocab_size: int, max_len: int, max_new_tokens: int) -> None:
    if not ids:
        raise BadRequest("empty prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"token id {bad[0]} out of range [0, {vocab_size})")
    if len(ids) + max_new_tokens > max_len:
        raise BadRequest(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"context length {max_len}")
