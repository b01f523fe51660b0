"""The value types of the server interface (:mod:`conformance.interfaces.server`): the per-scenario deadline,
the local-only rule and one generation as the scenarios see it.

Every HTTP call of a dialect is bounded: its timeout is the smaller of ``max_request_s`` and the time left on
the scenario's :class:`Deadline`; when the deadline has passed the call fails with an AssertionError naming
the scenario. The scenarios talk to a server only through a :class:`~conformance.interfaces.server.ServerDialect`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

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


@dataclass(frozen=True)
class TokenGeneration:
    """One sequence of a token-id request (:meth:`~conformance.interfaces.server.ServerDialect.generate_ids`): the
    prompt as the server saw it, the logprob it gives each prompt token after the first (``prompt_logprobs[j]``:
    token ``j + 1`` given tokens ``0..j``; None when the dialect returned none), the generated ids and their
    logprobs."""

    prompt_ids: tuple[int, ...]
    prompt_logprobs: tuple[float, ...] | None
    ids: tuple[int, ...]
    logprobs: tuple[float, ...]


def prompt_logprobs_from(entries: list, prompt: list[int], what: str) -> tuple[float, ...]:
    """Per prompt position after the first, the logprob of the prompt's own token from ``entries``: one per
    prompt token, the first None (every dialect's layout); ``entries[j]`` is ``(logprob, token id)``. An answer
    that does not cover the prompt token for token is an AssertionError naming ``what``."""
    if len(entries) != len(prompt):
        raise AssertionError(f"{what}: {len(entries)} prompt logprob entries for a {len(prompt)}-token prompt")
    out = []
    for j, (lp, tok) in enumerate(entries):
        if tok is not None and int(tok) != prompt[j]:
            raise AssertionError(f"{what}: prompt logprob entry {j} is for token {tok}, the prompt has {prompt[j]}")
        if j == 0:
            continue
        if lp is None:
            raise AssertionError(f"{what}: no logprob for prompt token {j} ({prompt[j]})")
        out.append(float(lp))
    return tuple(out)
