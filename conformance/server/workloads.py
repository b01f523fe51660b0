"""Workloads as data: the shapes of traffic the workload scenarios send, chosen so that the engine under test
computes forwards at every token count where engines switch their W4A16 code path (docs/server.md 'Workloads').

A :class:`Workload` names

* ``prefill_lengths``: prompts sent alone, one request each: a prefill forward of exactly that many tokens
  (M = the length), then decode at batch 1;
* ``decode_batches``: explicit batches, one request carrying that many prompts of ``short_length`` tokens:
  after their joint prefill, every decode step is a forward of M = the batch size (explicit, so the scheduler
  cannot change M: issue 39);
* ``repeat``: ``(batch, times)``: the same explicit batch sent ``times`` times: identical outputs (determinism
  under unordered reductions at one fixed M);
* ``mixed``: ``(long length, short requests)``: short requests sent concurrently and, while they decode, one
  long prompt (a long prefill arriving among decodes: vLLM mixes prefill chunks and decode rows in one forward);
* ``reload_batches``: after a reload of weight set ``b``, these explicit batches and the longest prefill again
  (each bucket must serve the new weights: a CUDA graph captured at start-up that replays stale weight pointers
  is a recurring engine bug);
* ``continuation``: greedy tokens generated per request (at least 64 in the built-ins).

Built-ins: ``quick`` (the tiny fixtures, 256 positions, on 2 CPU cores) and ``standard`` (real checkpoints on a
GPU); ``--workload NAME`` or ``--workload path/to/workload.toml`` (the fields above, see :func:`load`).

Buckets: token counts are reported in the buckets of :data:`GRID` (the union of the engines' own thresholds:
powers of two to 16384, which every grid of docs/server.md contains), so a failure says "prefill M 129-256",
"decode M 9-16".
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass, fields
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
#: the coverage map's rows: a prefill alone, a decode batch, and mixed traffic (its rows in forwards the
#: engine's scheduler composes: planned sizes are not the forwards' sizes there)
PHASES = ("prefill", "decode", "mixed")


def bucket(m: int) -> str:
    """The bucket of token count ``m``: '1', '2', '3-4', '5-8', ... '8193-16384', '>16384'."""
    if m < 1:
        raise ValueError(f"a token count is >= 1, got {m}")
    lo = 1
    for hi in GRID:
        if m <= hi:
            return str(hi) if lo == hi else f"{lo}-{hi}"
        lo = hi + 1
    return f">{GRID[-1]}"


def buckets_up_to(m: int) -> list[str]:
    """Every bucket from 1 to the one holding ``m``, in order."""
    out = []
    for hi in GRID:
        out.append(bucket(hi))
        if hi >= m:
            return out
    return out + [bucket(m)]


@dataclass(frozen=True)
class Workload:
    name: str
    prefill_lengths: tuple[int, ...]
    decode_batches: tuple[int, ...]
    short_length: int
    continuation: int
    repeat: tuple[int, int]
    mixed: tuple[int, int]
    reload_batches: tuple[int, ...]
    seed: int = 0
    notes: str = ""
    #: forward-mode probes of the truth per sequence (reference_impl/truth/probes.py): 64 puts the bound 16 %
    #: above the exact variance's at the same risk, 32 36 % (half the truth's cost)
    probes: int = 64
    #: probes drawn first (0: none): an answer whose every check is within the screen's threshold is decided on
    #: them, any other gets the rest (reference_impl/truth/probes.py, the screen: the verdicts differ with
    #: probability at most 1e-9 per check, and only ever where the full probes would fail)
    screen_probes: int = 8

    def check(self, max_positions: int | None = None, max_batch: int | None = None) -> None:
        """Raise ValueError naming the field that cannot work (or does not fit the model / the server)."""
        ints = {"prefill_lengths": self.prefill_lengths, "decode_batches": self.decode_batches,
                "reload_batches": self.reload_batches, "repeat": self.repeat, "mixed": self.mixed,
                "short_length": (self.short_length,), "continuation": (self.continuation,),
                "probes": (self.probes,)}
        for name, values in ints.items():
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"workload {self.name!r}: {name} must hold integers >= 1, got {values!r}")
        s = self.screen_probes
        if not isinstance(s, int) or s < 0 or (s and (s % 2 or s < 2 or s >= self.probes)):
            raise ValueError(f"workload {self.name!r}: screen_probes must be 0 (no screen) or an even number from 2 "
                             f"to fewer than probes ({self.probes}), got {s!r}")
        if self.continuation < 2:
            raise ValueError(f"workload {self.name!r}: continuation must be >= 2 (the first generated token comes from "
                             f"the prefill: one more is the decode's)")
        if len(self.repeat) != 2 or len(self.mixed) != 2:
            raise ValueError(f"workload {self.name!r}: repeat and mixed are pairs [batch, times] / [long length, "
                             f"short requests]")
        if max_positions is not None:
            longest = max(self.prefill_lengths + (self.mixed[0], self.short_length)) + self.continuation
            if longest > max_positions:
                raise ValueError(f"workload {self.name!r}: its longest sequence ({longest} tokens: prompt + "
                                 f"continuation {self.continuation}) exceeds the model's {max_positions} positions")
        if max_batch is not None:
            big = max(self.decode_batches + self.reload_batches + (self.repeat[0], self.mixed[1]))
            if big > max_batch:
                raise ValueError(f"workload {self.name!r}: a batch of {big} exceeds the {max_batch} prompts one "
                                 f"request may carry here")

    @property
    def pool_size(self) -> int:
        """Short prompts every batch draws from (batch b sends the first b): a correct engine gives a prompt the
        same continuation in every batch, so the truth judges it once."""
        return max(self.decode_batches + self.reload_batches + (self.repeat[0], self.mixed[1]))

    def prompts(self, vocab_size: int, length: int, count: int, salt: str) -> list[list[int]]:
        """``count`` prompts of exactly ``length`` token ids, drawn from ``[0, vocab_size)`` by a generator seeded
        with the workload's seed and ``salt`` (the same workload always sends the same prompts). Token ids,
        not text: a text prompt's length in tokens depends on the tokenizer; these are exact."""
        rng = random.Random(f"{self.seed}:{salt}:{length}:{count}")
        return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]

    def as_dict(self) -> dict:
        return asdict(self)


#: the tiny fixtures (256 positions, reference server batches up to 64 prompts) on 2 CPU cores: every regime of
#: ``standard`` at sizes off and on the grid, as far as CPU CI's time allows (the truth of every judged token
#: costs 32 probes on 2 cores: docs/truth.md): prefill to 129 tokens (past the 128 bucket), decode batches to 33
#: (past 32), 12 tokens generated
QUICK = Workload(
    name="quick",
    prefill_lengths=(1, 2, 5, 9, 17, 33, 65, 129),
    decode_batches=(1, 2, 3, 5, 9, 17, 33),
    short_length=4,
    continuation=12,
    repeat=(9, 3),
    mixed=(129, 4),
    reload_batches=(9, 33),
    notes="tiny fixtures on CPU: prefill to 129 tokens, decode batches to 33, 12 tokens generated",
    probes=32,
)

#: real checkpoints on a GPU: prefill from 1 to past the default chunk size (8192), decode batches through the
#: CUDA-graph buckets and past the largest (vLLM 512 tokens, SGLang 256 decode), sizes off the grids as well
STANDARD = Workload(
    name="standard",
    prefill_lengths=(1, 2, 3, 7, 8, 9, 16, 17, 31, 33, 48, 49, 64, 65, 177, 257, 263, 513, 1025, 2049, 4097, 8193),
    decode_batches=(1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 513),
    short_length=16,
    continuation=64,
    repeat=(33, 3),
    mixed=(8193, 32),
    reload_batches=(9, 65, 257),
    notes="real checkpoints on one GPU; the engines' thresholds these sizes straddle are in docs/server.md",
)

BUILTINS = {w.name: w for w in (QUICK, STANDARD)}


def load(spec: str) -> Workload:
    """A built-in name, or a TOML file holding :class:`Workload`'s fields (``name`` defaults to the file's stem;
    lists for the tuples). A bad file is a ValueError naming the field."""
    if spec in BUILTINS:
        return BUILTINS[spec]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--workload {spec!r}: not a built-in ({', '.join(BUILTINS)}) nor a file")
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"--workload {spec}: not valid TOML: {exc}") from exc
    known = {f.name for f in fields(Workload)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"--workload {spec}: unknown fields {unknown}; known: {sorted(known)}")
    data.setdefault("name", path.stem)
    # the fields without a default (both are MISSING): seed, notes, probes, screen_probes may be left out
    missing = sorted(f.name for f in fields(Workload) if f.name not in data and f.default is f.default_factory)
    if missing:
        raise ValueError(f"--workload {spec}: missing fields {missing}")
    try:
        w = Workload(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
    except TypeError as exc:
        raise ValueError(f"--workload {spec}: {exc}") from exc
    w.check()
    return w


__all__ = ["GRID", "PHASES", "Workload", "QUICK", "STANDARD", "BUILTINS", "bucket", "buckets_up_to", "load"]
