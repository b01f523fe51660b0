"""Diagnosis: when checks fail together in a recognisable pattern, say what kind of bug it looks like.

A failing check says *what* is wrong (a bound exceeded, two runs differing); a kernel author wants to know
*why*. A :class:`Rule` is data: the checks that must fail, the checks that must pass, case features the case
must have, *facts* (figures computed from the failing run, e.g. "the output matches the checkpoint read with
its nibbles swapped"), and an explanation. :func:`diagnose` returns every rule an :class:`Evidence` matches,
most specific first. A :class:`Pattern` is a rule over many cases of one backend: a check that fails exactly
on the cases with a feature (``K % 64 != 0``) or beyond a size (``M > 128``), see :func:`diagnose_cases`.

Rules name checks by the names of their area's check registry (``conformance.dense.checks.NAMED_CHECKS``,
the bracketed tags of ``conformance.moe.checks``), so the rule tables can hang off a single check registry
later. A rule can only fire when a check fails: a correct backend gets no diagnosis. A diagnosis is a
*likely* cause, stated with the evidence it rests on; the check's own verdict is unchanged by it.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

#: The heading diagnoses carry in failure messages and reports.
LIKELY_CAUSE = "likely cause"


@dataclass(frozen=True)
class Evidence:
    """One case run through one backend: which named checks failed and passed, the case's features and
    sizes, and facts computed from the run (name -> value; a rule needs the facts it names to be truthy)."""

    area: str
    failing: frozenset[str]
    passing: frozenset[str]
    features: frozenset[str] = frozenset()
    shape: Mapping[str, int] = field(default_factory=dict)
    facts: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Rule:
    """``fails``: every one must fail; ``fails_any``: at least one must fail (when given); ``passes``: every one
    must have been evaluated and passed; ``features``: the case has all; ``facts``: each is truthy in the
    evidence. ``explanation`` may use ``{fact}`` placeholders, filled from the evidence's facts."""

    name: str
    area: str
    explanation: str
    fails: frozenset[str] = frozenset()
    fails_any: frozenset[str] = frozenset()
    passes: frozenset[str] = frozenset()
    features: frozenset[str] = frozenset()
    facts: tuple[str, ...] = ()

    @classmethod
    def of(cls, name: str, area: str, explanation: str, **kw: Iterable[str]) -> Rule:
        """A rule from plain iterables: the check and feature names become frozensets, ``facts`` a tuple."""
        return cls(name, area, explanation, **{k: frozenset(v) if k != "facts" else tuple(v) for k, v in kw.items()})

    def __post_init__(self) -> None:
        if not (self.fails or self.fails_any):
            raise ValueError(f"rule {self.name!r} names no failing check: it could fire on a correct backend")

    def matches(self, ev: Evidence) -> bool:
        return (
            ev.area == self.area
            and self.fails <= ev.failing
            and (not self.fails_any or bool(self.fails_any & ev.failing))
            and self.passes <= ev.passing
            and self.features <= ev.features
            and all(ev.facts.get(f) for f in self.facts)
        )

    @property
    def specificity(self) -> int:
        return len(self.fails) + bool(self.fails_any) + len(self.passes) + len(self.features) + 2 * len(self.facts)


@dataclass(frozen=True)
class Diagnosis:
    rule: str
    text: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.text}"


def diagnose(rules: Iterable[Rule], ev: Evidence) -> list[Diagnosis]:
    """The rules ``ev`` matches, most specific first (ties in table order)."""
    hits = sorted((r for r in rules if r.matches(ev)), key=lambda r: -r.specificity)
    return [Diagnosis(r.name, r.explanation.format_map(_Facts(ev.facts))) for r in hits]


class _Facts(dict):
    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def format_diagnoses(diagnoses: Iterable[Diagnosis], indent: str = "  ") -> str:
    """Lines to append to a failure message ('' when there is none)."""
    return "".join(f"\n{indent}{LIKELY_CAUSE} [{d.rule}]: {d.text}" for d in diagnoses)


@contextmanager
def appending_diagnoses(evaluate: Callable[[], list[Diagnosis]],
                        record: Callable[[str, str], None] | None = None) -> Iterator[None]:
    """Run checks inside; when one fails, ``evaluate()`` (an area's: every named check on the same run, then its
    rules) gives the diagnoses, appended to the failure message as "likely cause" lines and given to ``record``
    as the ``diagnosis`` property. The verdict is the check's; a diagnosis that cannot be computed (the backend
    fails again) leaves the message as it was."""
    try:
        yield
    except AssertionError as exc:
        try:
            diagnoses = evaluate()
        except Exception:  # noqa: BLE001 - the original failure is what the user must see
            raise exc from None
        if not diagnoses:
            raise
        if record is not None:
            record("diagnosis", "; ".join(str(d) for d in diagnoses))
        raise AssertionError(f"{exc}{format_diagnoses(diagnoses)}").with_traceback(exc.__traceback__) from None


# ----------------------------------------------------------------------------------------- across cases
@dataclass(frozen=True)
class CaseOutcome:
    """One case of one backend: the named checks (or tests) that failed on it, its features and sizes."""

    case_id: str
    failing: frozenset[str]
    features: frozenset[str]
    shape: Mapping[str, int]


@dataclass(frozen=True)
class Pattern:
    """``check`` fails on at least ``min_failing`` cases, and only where ``feature`` holds (every failing case
    has it, at least ``min_passing`` passing cases lack it, at least ``min_share`` of the cases with it fail:
    a bug need not show on every case of its class), or only beyond a size (``dimension`` on every failing case larger than on
    any passing one). The explanation may use ``{check}``, ``{failing}``, ``{passing}``, ``{threshold}`` and
    ``{largest_passing}``."""

    name: str
    area: str
    explanation: str
    feature: str | None = None
    dimension: str | None = None
    min_failing: int = 2  # one failing case has every feature it has: no pattern
    min_passing: int = 2
    #: of the cases with the feature, at least this share fails (a common feature, e.g. N % 128 != 0 on most
    #: small cases, must not be blamed for a bug that shows on a few of them)
    min_share: float = 0.5

    def __post_init__(self) -> None:
        if (self.feature is None) == (self.dimension is None):
            raise ValueError(f"pattern {self.name!r}: give exactly one of feature and dimension")


def diagnose_cases(patterns: Iterable[Pattern], outcomes: Iterable[CaseOutcome], area: str) -> list[Diagnosis]:
    """Patterns over the cases of one backend and area: for each check that fails somewhere, the patterns that
    set its failing cases apart from its passing ones. Checks failing on the same cases under the same pattern
    are reported together."""
    outcomes = list(outcomes)
    found: dict[tuple[str, frozenset[str]], tuple[Pattern, list[str], dict]] = {}
    for check in sorted({c for o in outcomes for c in o.failing}):
        failing = [o for o in outcomes if check in o.failing]
        passing = [o for o in outcomes if check not in o.failing]
        for p in patterns:
            fmt = _pattern_holds(p, area, failing, passing, outcomes)
            if fmt is not None:
                key = (p.name, frozenset(o.case_id for o in failing))
                found.setdefault(key, (p, [], {"failing": len(failing), "passing": len(passing), **fmt}))[1].append(check)
    return [Diagnosis(p.name, p.explanation.format(check=" / ".join(checks), **fmt))
            for p, checks, fmt in found.values()]


def _pattern_holds(p: Pattern, area: str, failing: list[CaseOutcome], passing: list[CaseOutcome],
                   outcomes: list[CaseOutcome]) -> dict | None:
    """The pattern's format values when it separates ``failing`` from ``passing``, else None."""
    if p.area != area or len(failing) < p.min_failing:
        return None
    if p.feature is not None:
        with_feature = sum(p.feature in o.features for o in passing)
        without = len(passing) - with_feature
        holds = (all(p.feature in o.features for o in failing) and without >= p.min_passing
                 and len(failing) >= p.min_share * (len(failing) + with_feature))
        return {} if holds else None
    if len(passing) < p.min_passing or not all(p.dimension in o.shape for o in outcomes):
        return None
    threshold = min(o.shape[p.dimension] for o in failing)
    largest = max(o.shape[p.dimension] for o in passing)
    return {"threshold": threshold, "largest_passing": largest} if threshold > largest else None
