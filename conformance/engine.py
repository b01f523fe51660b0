"""Deprecated since 0.2.0: the 0.1 rules interface's module. Import from :mod:`conformance.interfaces.rules`.

Kept as an alias (the very same class, so a 0.1 ``RulesEngine`` subclass is a 0.2 one) for at least the 0.2
releases; it goes in 0.3. CHANGELOG.md lists every moved import.
"""
from __future__ import annotations

import warnings

from conformance.interfaces.rules import OPTIONAL_METHODS, RulesEngine

__all__ = ["OPTIONAL_METHODS", "RulesEngine"]

warnings.warn("conformance.engine is deprecated since 0.2.0 and goes in 0.3: import RulesEngine from "
              "conformance.interfaces.rules", DeprecationWarning, stacklevel=2)
