"""The moe bounds' old home (0.2): they live in :mod:`reference_impl.bounds.moe` (shared by several areas);
the names are re-exported here for code written against 0.2."""
from __future__ import annotations

from reference_impl.bounds.moe import (  # noqa: F401
    ABS_FLOOR,
    CONTRIB_ROUNDING,
    E4M3_REL,
    E4M3_SUBNORMAL_HALF_STEP,
    EVAL_GATED,
    EVAL_RELU2,
    ErrorFigures,
    FP64_REL,
    L_GELU,
    L_SILU,
    MoEBound,
    U_ACC,
    U_BF16,
    activation_evaluation_error,
    activation_perturbation,
    error_figures,
    gamma,
    moe_error_bound,
    quantization_error_bound,
    recipe_independent_error_bound,
    weight_perturbation_bound,
)
