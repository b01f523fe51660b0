"""Report text that needs nothing of the report's records: a Markdown table cell, and the known failures that did
not show in a run (the XPASS of a non-strict expectation entry: listed in the JSON summary under
:data:`NOT_SHOWN_KEY` and in report.md's section of the same title)."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from conformance._framework.expectations import ENTRY_PROPERTY, REASON_PROPERTY, WHY_NOT_STRICT_PROPERTY


_MAX_IDS_IN_TABLE = 4


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def fmt_ids(ids: list[str]) -> str:
    """Test ids, short (their part after the file), the first few and how many more."""
    if not ids:
        return ""
    short = [f"`{i.split('::', 1)[-1]}`" for i in ids[:_MAX_IDS_IN_TABLE]]
    more = f" +{len(ids) - _MAX_IDS_IN_TABLE} more" if len(ids) > _MAX_IDS_IN_TABLE else ""
    return ", ".join(short) + more


def markdown_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


#: The JSON summary's list of :func:`known_failures_not_shown` (a stable key: CI may read it).
NOT_SHOWN_KEY = "known_failures_not_shown"
NOT_SHOWN_TITLE = "Known failures that did not show (non-strict XPASS)"
NOT_SHOWN_HINT = "If this keeps passing, the engine may have been fixed: remove the entry or make it strict."


def known_failures_not_shown(tests: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every test whose known failure did not show in this run: outcome ``xpassed``, the XPASS of a non-strict
    expected failure (a ``strict = false`` expectation entry), which does not fail the run. Each as ``nodeid``,
    ``backend``, ``tier``, ``entry`` (the expectation entry's id), ``reason`` and ``why_not_strict`` (from the
    entry; ``None`` for an xfail marker outside an expectations file, its reason taken from the message)."""
    out = []
    for t in tests:
        if t["outcome"] != "xpassed":
            continue
        props = t.get("properties", {})  # the entry, as the expectations plugin records it on the test
        out.append({"nodeid": t["nodeid"], "backend": t["backend"], "tier": t["tier"],
                    "entry": props.get(ENTRY_PROPERTY), "reason": props.get(REASON_PROPERTY) or t.get("message", ""),
                    "why_not_strict": props.get(WHY_NOT_STRICT_PROPERTY)})
    return out


def not_shown_section(not_shown: list[Mapping[str, Any]]) -> list[str]:
    """The non-strict known failures that did not show this run (:func:`known_failures_not_shown`): not a
    failure, but a sign the engine may have been fixed, so the entry should go or become strict."""
    if not not_shown:
        return []
    lines = ["", f"## {NOT_SHOWN_TITLE}", "",
             "These tests are covered by a non-strict `[[xfail]]` expectation entry (`strict = false`) and passed: "
             "the known failure did not show in this run. Not a failure; the verdict does not count them. "
             + NOT_SHOWN_HINT, "",
             "| Case | Entry | Reason | Why not strict |", "| --- | --- | --- | --- |"]
    for t in not_shown:
        entry = f"`{markdown_cell(t['entry'])}`" if t["entry"] else "-"
        lines.append(f"| `{markdown_cell(t['nodeid'])}` | {entry} | {markdown_cell(t['reason'] or '-')} "
                     f"| {markdown_cell(t['why_not_strict'] or '-')} |")
    return lines
