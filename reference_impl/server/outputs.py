"""From an engine result to what a client sees: stop strings and stop regexes, trimming of the matched stop,
special tokens. Shared by the native (SGLang) and the OpenAI-compatible endpoints.

Stop strings are matched on the decoded output after generation and the output is cut at the first token
whose text completes a match. That equals stopping there during generation because a request's tokens do
not depend on its batch or on later tokens (no KV cache, per-request seeded generator); it only costs the
steps after the match. The rules follow SGLang 0.5.23 (``Req._check_str_based_finish``,
``DetokenizerManager.trim_matched_stop``): stop strings beat a stop token found at the same step, the
matched stop string (or stop token) is trimmed from the text unless ``no_stop_trim``, ``output_ids`` keep
every generated token up to and including the match.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import regex  # the `re` syntax, with a timeout that interrupts catastrophic backtracking and no GIL held

from reference_impl.server.api_common import BadRequest
from reference_impl.server.engine import GenerateResult
from reference_impl.server.logprobs import InputLogprobs, Pairs

#: the time all of a request's stop-regex searches may take together: a pattern that still backtracks
#: catastrophically under `regex` ("(.*){1,32000}[QX]") fails the request with a 400 instead of holding the server
STOP_REGEX_BUDGET_S = 1.0
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class TextOptions:
    stop: tuple[str, ...] = ()
    stop_regex: tuple[str, ...] = ()
    no_stop_trim: bool = False
    skip_special_tokens: bool = True


@dataclass
class Completion:
    """One finished sequence, cut at its stop."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: dict
    text: str
    top_logprobs: list[Pairs | None] = field(default_factory=list)
    token_ids_logprobs: list[Pairs | None] = field(default_factory=list)
    input_logprobs: InputLogprobs | None = None


class Detokenizer:
    """The server's tokenizer with the special tokens that ``tokenizer_config.json`` declares registered as
    special, as transformers' ``PreTrainedTokenizerFast`` (and so SGLang and vLLM) treat them: they are
    dropped from decoded text when ``skip_special_tokens`` is set. ``spaces_between_special_tokens`` only
    affects slow (Python) tokenizers in transformers; with this fast tokenizer it changes nothing, as there."""

    def __init__(self, tokenizer, tokenizer_dir: str | Path | None):
        self.tokenizer = tokenizer
        self.special = self._register_special_tokens(tokenizer, tokenizer_dir)

    @staticmethod
    def _register_special_tokens(tokenizer, tokenizer_dir) -> tuple[str, ...]:
        path = Path(tokenizer_dir) / "tokenizer_config.json" if tokenizer_dir else None
        if path is None or not path.is_file():
            return ()
        config = json.loads(path.read_text())
        names = [config.get(k) for k in SPECIAL_TOKEN_KEYS] + list(config.get("additional_special_tokens") or [])
        names = [n.get("content") if isinstance(n, dict) else n for n in names]
        # only tokens already in the vocabulary: new ids would lie outside the model's output range
        special = tuple(dict.fromkeys(n for n in names if isinstance(n, str) and tokenizer.token_to_id(n) is not None))
        if special:
            tokenizer.add_special_tokens(list(special))
        return special

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. An id the tokenizer does not have (a tokenizer smaller than the model's vocabulary)
        is written as ``<|token_id=N|>``: it is never silently dropped (``tokenizers`` would drop it)."""
        size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        parts, run = [], []
        for t in map(int, ids):
            if 0 <= t < size:
                run.append(t)
                continue
            if run:
                parts.append(self.tokenizer.decode(run, skip_special_tokens=skip_special_tokens))
                run = []
            parts.append(f"<|token_id={t}|>")
        if run or not parts:
            parts.append(self.tokenizer.decode(run, skip_special_tokens=skip_special_tokens))
        return "".join(parts)

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (as transformers' batch_decode of single ids)."""
        return self.decode([token_id], skip_special_tokens=False)

    def finish(self, res: GenerateResult, opts: TextOptions) -> Completion:
        ids, finish = list(res.output_ids), res.finish_reason
        cut = self._stop_match(ids, opts)
        if cut is not None:
            n, matched = cut
            finish = {"type": "stop", "matched": matched}
            ids = ids[:n]
        text = self._trimmed_text(ids, finish, opts)
        n = len(ids)
        return Completion(ids, list(res.logprobs[:n]), finish, text, list(res.top_logprobs[:n]),
                          list(res.token_ids_logprobs[:n]), res.input_logprobs)

    def _stop_match(self, ids: list[int], opts: TextOptions) -> tuple[int, str] | None:
        """(tokens kept, matched stop) at the first token whose text completes a stop string or regex."""
        if not opts.stop and not opts.stop_regex:
            return None
        deadline = time.monotonic() + STOP_REGEX_BUDGET_S
        for n in range(1, len(ids) + 1):
            text = self.decode(ids[:n], skip_special_tokens=False)  # SGLang's Req.tail_str decodes everything
            for stop in opts.stop:
                if stop and stop in text:
                    return n, stop
            for pattern in opts.stop_regex:
                if _search(pattern, text, deadline):
                    return n, pattern
        return None

    def _trimmed_text(self, ids: list[int], finish: dict, opts: TextOptions) -> str:
        matched = finish.get("matched") if finish else None
        if isinstance(matched, int) and ids and not opts.no_stop_trim:
            ids = ids[:-1]  # a stop token (EOS or stop_token_ids) is not part of the text
        text = self.decode(ids, opts.skip_special_tokens)
        if isinstance(matched, str):
            if matched in opts.stop:
                pos = text.find(matched)
                span = (pos, pos + len(matched)) if pos >= 0 else None
            else:  # a stop regex: cut at its match (SGLang 0.5.23 only cuts where the pattern text appears)
                m = _search(matched, text, time.monotonic() + STOP_REGEX_BUDGET_S)
                span = m.span() if m else None
            if span is not None:
                text = text[: span[1]] if opts.no_stop_trim else text[: span[0]]
        return text


def _search(pattern: str, text: str, deadline: float):
    """``regex.search`` bounded by ``deadline`` (monotonic); past it, a 400 naming the pattern."""
    try:
        return regex.search(pattern, text, timeout=max(deadline - time.monotonic(), 1e-3), concurrent=True)
    except TimeoutError as exc:
        raise BadRequest(f"stop_regex {pattern!r}: its evaluation took over {STOP_REGEX_BUDGET_S:g} s (catastrophic "
                         f"backtracking, e.g. a nested quantifier); rewrite the pattern") from exc


def compile_stop_regex(patterns: tuple[str, ...]) -> None:
    """Reject a malformed or oversized pattern up front (SGLang: MAX_STOP_REGEX_LEN = 256 bytes)."""
    for p in patterns:
        if len(p.encode("utf-8", "surrogatepass")) > 256:
            raise BadRequest(f"stop_regex {p!r} is over the 256-byte limit")
        try:
            regex.compile(p)
        except regex.error as exc:
            raise BadRequest(f"invalid stop_regex {p!r}: {exc}") from exc
