"""Deprecated since 0.2.0: the 0.1 kernel interface's module. Import from :mod:`conformance.interfaces.kernel`.

Kept as an alias (the very same classes, so a 0.1 ``Backend`` subclass is a 0.2 one) for at least the 0.2
releases; it goes in 0.3. CHANGELOG.md lists every moved import.
"""
from __future__ import annotations

import warnings

from conformance.interfaces.kernel import Backend, CaseInfo, DenseLayer, MoEExperts

__all__ = ["Backend", "CaseInfo", "DenseLayer", "MoEExperts"]

warnings.warn("conformance.adapter is deprecated since 0.2.0 and goes in 0.3: import Backend, CaseInfo, "
              "DenseLayer and MoEExperts from conformance.interfaces.kernel", DeprecationWarning, stacklevel=2)
