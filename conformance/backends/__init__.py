"""Backend selection (kept for code written against 0.2): ``--backend NAME`` for a built-in one (the selection
table's ``kernel`` column), ``--backend module:attr`` for a vendor's, several separated by commas. Without
``--backend`` (and without ``$NVFP4_CONFORMANCE_BACKEND``) the suite runs the reference backend and FlashInfer's
W4A16 kernels (the ``b200`` tier: skipped, with the reason, elsewhere). The loading lives in
:mod:`conformance._framework.selection`; the names below are re-exported from it."""
from __future__ import annotations

from conformance._framework.selection import (
    BACKEND_ENV_VAR,
    DEFAULT_BACKEND,
    BackendLoadError,
    backend_spec_from_env,
    builtin_backends,
    load_backends,
)

#: built-in name -> ``module:attr`` (a view of the selection table)
BUILTIN_BACKENDS = builtin_backends()

__all__ = ["BACKEND_ENV_VAR", "BUILTIN_BACKENDS", "DEFAULT_BACKEND", "BackendLoadError", "backend_spec_from_env",
           "load_backends"]
