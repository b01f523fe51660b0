"""Errors an implementation raises to tell the suite something about itself (not a failure of a check)."""
from __future__ import annotations

__all__ = ["EngineUnavailable"]


class EngineUnavailable(RuntimeError):
    """The engine exists but cannot run on this host (e.g. not installed): its cases skip with this reason
    (and fail when the engine was asked for by name). Each engine's own "not importable" error derives from it."""
