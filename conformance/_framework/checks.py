"""One registry of checks, for every area: a check is a function registered once with :func:`check` and found by
``(area, name)``.

A check takes the area's *run* (one case through one implementation: it has a ``case``) and, if it declares
them, ``backend`` (the implementation, for checks that call it again) and ``record`` (a callback receiving the
figures before the assertion, so a failing case's report shows how far out it was). It raises
``AssertionError`` with a readable report when the implementation is wrong, and may return figures.

* An area's conformance test module runs, per case, the checks registered for that test
  (:func:`checks_for`, ``test=``; a check registered without ``test`` runs in the area's main test, the one
  named in :func:`register_area`), each only on the cases it ``applies_to``.
* A mutant in tests/ names the registered check that must catch it (``caught_by``); :func:`failing_checks`
  runs every check of an area on one run and says which fail, by name.
* docs/contributing.md's tables of checks are generated from this registry (:func:`markdown_table`; a test keeps
  the docs equal to it).

Adding a check to an area is one decorated function; nothing else names it.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Check", "check", "checks_for", "failing_checks", "get_check", "markdown_table", "register_area", "view"]

_PARAMETERS = ("run", "backend", "record")


@dataclass(frozen=True)
class Check:
    """A registered check: ``function(run[, backend][, record])``; ``applies_to(case)`` selects its cases (None:
    all); ``test`` the conformance test that runs it; ``own_run``: it calls the implementation again on state
    the other checks leave behind, so :func:`failing_checks` gives it a fresh run when it can."""

    area: str
    name: str
    function: Callable[..., Any]
    explicit_test: str | None = None
    applies_to: Callable[[Any], bool] | None = None
    own_run: bool = False

    @property
    def test(self) -> str | None:
        """The conformance test that runs this check: its own, else the area's main test."""
        return self.explicit_test or _AREAS.get(self.area)

    @property
    def summary(self) -> str:
        """The first sentence of the function's docstring (what it checks)."""
        doc = " ".join((inspect.getdoc(self.function) or "").split("\n\n")[0].split())
        end = doc.find(". ")
        return (doc[:end + 1] if end >= 0 else doc).replace("|", "\\|")

    def applies(self, case: Any) -> bool:
        return self.applies_to is None or bool(self.applies_to(case))

    def __call__(self, run: Any, backend: Any = None, record: Callable[[Any], None] | None = None) -> Any:
        given = {"run": run, "backend": backend, "record": record}
        params = inspect.signature(self.function).parameters
        return self.function(**{p: given[p] for p in params if p in given})


_AREAS: dict[str, str] = {}  # area -> its main test
_CHECKS: dict[str, dict[str, Check]] = {}


def register_area(area: str, main_test: str) -> None:
    """Declare an area and the test that runs its checks registered without ``test``."""
    _AREAS[area] = main_test
    _CHECKS.setdefault(area, {})


def check(area: str, name: str | None = None, *, test: str | None = None,
          applies_to: Callable[[Any], bool] | None = None, own_run: bool = False) -> Callable:
    """Register the decorated function as the check ``name`` (default: the function's name) of ``area``; the
    function is returned unchanged (still callable directly). The area may be declared later
    (:func:`register_area`): a contributor's module can register a check before the area's own checks load."""

    def register(function: Callable) -> Callable:
        unknown = [p.name for p in inspect.signature(function).parameters.values()
                   if p.name not in _PARAMETERS and p.default is inspect.Parameter.empty]
        if unknown:
            raise TypeError(f"check {function.__name__} requires {unknown}: a check is given only {_PARAMETERS}")
        key = name or function.__name__
        registered = _CHECKS.setdefault(area, {}).get(key)
        same = registered is not None and (registered.function.__module__, registered.function.__qualname__) == (
            function.__module__, function.__qualname__)  # the module imported again (e.g. a nested pytest run)
        if registered is not None and not same:
            raise ValueError(f"check {area}/{key} is registered twice ({registered.function.__module__} and "
                             f"{function.__module__})")
        _CHECKS[area][key] = Check(area, key, function, test, applies_to, own_run)
        return function
    return register


def checks_for(area: str, test: str | None = None) -> tuple[Check, ...]:
    """The checks of ``area`` in registration order (only those run by ``test``, when given)."""
    return tuple(c for c in _CHECKS.get(area, {}).values() if test is None or c.test == test)


def get_check(area: str, name: str) -> Check:
    try:
        return _CHECKS[area][name]
    except KeyError:
        raise KeyError(f"no check {name!r} in area {area!r} (registered: {sorted(_CHECKS.get(area, {}))})") from None


class _View(Mapping):
    """``{name: Check}`` of one area, live (a check registered later is in it)."""

    def __init__(self, area: str) -> None:
        self.area = area

    def __getitem__(self, name: str) -> Check:
        return get_check(self.area, name)

    def __iter__(self) -> Iterator[str]:
        return iter([c.name for c in checks_for(self.area)])

    def __len__(self) -> int:
        return len(checks_for(self.area))


def view(area: str) -> Mapping[str, Check]:
    """The checks of ``area`` as a read-only mapping by name (each callable as ``check(run, backend)``)."""
    return _View(area)


def _tag(message: str) -> str | None:
    """A failure message may start with ``[name]``: the check that actually failed (e.g. the output contract,
    checked first inside the bound check)."""
    return message[1:message.index("]")] if message.startswith("[") and "]" in message else None


def failing_checks(area: str, run: Any, backend: Any, fresh_run: Callable[[], Any] | None = None) -> dict[str, str]:
    """Every check of ``area`` that applies to ``run.case``, each on its own: ``{name: first line of its
    failure}`` for those that fail (named by the failure's ``[tag]`` when it has one). Checks marked
    ``own_run`` run last, on ``fresh_run()`` when given."""
    failures: dict[str, str] = {}
    ordered = sorted(checks_for(area), key=lambda c: c.own_run)
    for c in ordered:
        if not c.applies(run.case):
            continue
        try:
            c(fresh_run() if c.own_run and fresh_run is not None else run, backend)
        except AssertionError as exc:
            message = str(exc)
            failures.setdefault(_tag(message) or c.name, message.splitlines()[0])
    return failures


def markdown_table(area: str) -> str:
    """The checks of ``area`` as a Markdown table: name, the test that runs it, what it checks."""
    rows = ["| Check | Run by | What it checks |", "| --- | --- | --- |"]
    rows += [f"| `{c.name}` | `{c.test}` | {c.summary} |" for c in checks_for(area)]
    return "\n".join(rows) + "\n"
