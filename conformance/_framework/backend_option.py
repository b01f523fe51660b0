"""``--backend`` (0.2's module): the option and the ``backend`` parametrization live in the one selection plugin,
:mod:`conformance._framework.selection_plugin`; :func:`backends_of` is re-exported here."""
from __future__ import annotations

from conformance._framework.selection_plugin import backends_of

__all__ = ["backends_of"]
