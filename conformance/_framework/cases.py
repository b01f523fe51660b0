"""Cases as data (in the spirit of PyTorch's OpInfo ``SampleInput``/``ErrorInput``).

A case names its inputs, its expected outcome and its hardware tier. Area modules define their own
frozen dataclasses with these three parts and turn lists of them into pytest parameters with
:func:`as_params`, so each case is one readable test id carrying its tier marker.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import pytest

from conformance._framework.tiers import TIERS, stricter_tier


@dataclass(frozen=True)
class WithinBound:
    """Expect a value within a derived bound; ``bound`` names the bound function (for reports)."""

    bound: str


@dataclass(frozen=True)
class Raises:
    """Expect an exception of ``exc_type`` whose message matches the regular expression ``match``."""

    exc_type: type[BaseException]
    match: str = ""

    def check(self, exc: BaseException) -> None:
        assert isinstance(exc, self.exc_type), (
            f"expected {self.exc_type.__name__} matching {self.match!r}, got {type(exc).__name__}: {exc}"
        )
        assert re.search(self.match, str(exc)), (
            f"{type(exc).__name__} raised, but its message {str(exc)!r} does not match {self.match!r}"
        )


@dataclass(frozen=True)
class Equals:
    """Expect exactly ``value`` (an outcome of a rule, a code, a byte)."""

    value: Any


Expectation = WithinBound | Raises | Equals


class Case(Protocol):
    id: str
    tier: str


C = TypeVar("C")


def case_for_backend(case: C, backend: Any) -> C:
    """``case`` as run against ``backend``: on the stricter of the case's tier and the backend's ``tier``
    (the tier marker of the test already says so; the case's device follows), same id and seed. A cpu case
    run against a ``b200`` backend runs on that backend's device."""
    tier = stricter_tier(case.tier, getattr(backend, "tier", "cpu"))
    return case if tier == case.tier else dataclasses.replace(case, tier=tier)


def as_params(cases: Iterable[Case], extra_marks: Sequence[pytest.MarkDecorator] = ()) -> list:
    """``pytest.param`` per case with its id and its tier marker; rejects duplicate ids and unknown tiers."""
    params, seen = [], set()
    for case in cases:
        if case.tier not in TIERS:
            raise ValueError(f"case {case.id!r} has unknown tier {case.tier!r}")
        if case.id in seen:
            raise ValueError(f"duplicate case id {case.id!r}")
        seen.add(case.id)
        params.append(pytest.param(case, id=case.id, marks=[getattr(pytest.mark, case.tier), *extra_marks]))
    return params
