"""Logprobs beyond the chosen token's, as SGLang's ``/generate`` and the OpenAI ``/v1/completions`` ask
for them: the top-k alternatives at each position (``top_logprobs_num`` / ``logprobs``), the logprobs of
named token ids (``token_ids_logprob``) and the logprobs of prompt tokens (``logprob_start_len`` /
``echo``).

Every logprob is ``log_softmax`` of the model's fp64 logits (before temperature, top-k/top-p/min-p and the
``min_new_tokens`` mask), the same quantity as the chosen token's logprob, so a token's logprob is
identical whether it is reported as chosen, as a top-k alternative or as a named id.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

Pairs = list[tuple[float, int]]  # (logprob, token id), as SGLang orders them


@dataclass(frozen=True)
class LogprobRequest:
    """What a request wants reported besides the chosen tokens' logprobs."""

    top_k: int = 0  # alternatives per position (0: none)
    token_ids: tuple[int, ...] | None = None  # ids whose logprobs are reported at every position
    input_start: int = -1  # prompt positions >= this get logprobs too (-1: none)

    def wants_input(self, prompt_len: int) -> bool:
        return 0 <= self.input_start < prompt_len


@dataclass
class InputLogprobs:
    """Prompt tokens ``input_ids[start + 1:]`` scored by the model (entry j-start-1: the logprob of
    ``input_ids[j]`` given ``input_ids[:j]``). ``input_ids[start]`` itself has no entry: SGLang reports
    ``None`` there (its first scored position has no prefix inside the window)."""

    start: int
    logprobs: list[float] = field(default_factory=list)
    top: list[Pairs] | None = None
    token_ids: list[Pairs] | None = None
    ranks: list[int] = field(default_factory=list)  # 1 + how many tokens are more likely (vLLM's rank)


def position_extras(row: torch.Tensor, req: LogprobRequest) -> tuple[Pairs | None, Pairs | None]:
    """(top-k alternatives, named ids' logprobs) of one position's log-probabilities ``row`` [V]."""
    top = None
    if req.top_k > 0:
        values, ids = torch.topk(row, min(req.top_k, row.numel()))
        top = list(zip(values.tolist(), ids.tolist()))
    named = [(float(row[t]), int(t)) for t in req.token_ids] if req.token_ids is not None else None
    return top, named


def score_prompt(logprobs: torch.Tensor, input_ids: tuple[int, ...], req: LogprobRequest) -> InputLogprobs:
    """``logprobs`` [T, V]: log-probabilities at every prompt position (row r predicts token r + 1)."""
    out = InputLogprobs(req.input_start, top=[] if req.top_k > 0 else None,
                        token_ids=[] if req.token_ids is not None else None)
    for j in range(req.input_start + 1, len(input_ids)):
        row = logprobs[j - 1]
        out.logprobs.append(float(row[input_ids[j]]))
        out.ranks.append(1 + int((row > row[input_ids[j]]).sum()))
        top, named = position_extras(row, req)
        if out.top is not None:
            out.top.append(top)
        if out.token_ids is not None:
            out.token_ids.append(named)
    return out
