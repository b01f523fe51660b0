"""The OpenAI-compatible API as a server dialect: :class:`OpenAIDialect` lives in
:mod:`conformance.interfaces.server_openai` (adapters extend it from there); re-exported here."""
from __future__ import annotations

from conformance.interfaces.server_openai import OpenAIDialect  # noqa: F401 - re-exported

__all__ = ["OpenAIDialect"]
