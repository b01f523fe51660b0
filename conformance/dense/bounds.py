"""The dense bounds' old home (0.2): they live in :mod:`reference_impl.bounds.dense` (shared by several areas);
the names are re-exported here for code written against 0.2."""
from __future__ import annotations

from reference_impl.bounds.dense import (  # noqa: F401
    ErrorFigures,
    FLASHINFER_MAX_REL_L2,
    FLASHINFER_MIN_COSINE,
    TINY_NORMAL,
    U_ACCUM,
    U_BF16,
    U_FP32,
    dense_error_bound,
    error_figures,
    gamma,
)
