"""Tolerances of the server scenarios, each with its derivation (``golden_bound``: at the end of this module).

``RELOAD_LOGPROB_TOL``: the upstream engine's own reload test (SGLang, TestServerUpdateWeightsFromDiskNVFP4
W4A16CuteDSL) accepts per-token logprob differences up to 1e-4 after reloading the same checkpoint; we keep
its value so the scenario is the engine's scenario exactly. Token ids and text must be identical.

``tp_logprob_bound``: tensor parallelism changes only the order of the reductions of the row-parallel
layers (attention output and MLP down projections, ``2 * L`` of them) and, in engines that reduce in BF16,
adds up to ``tp`` BF16 roundings per reduction. Each rounding is a relative perturbation of at most
``2^-8`` (BF16 unit roundoff, 8 significant bits). To first order relative perturbations of the residual
stream add across layers and RMSNorm removes any change of scale, so the final hidden state moves by at
most ``2 * L * tp * 2^-8`` relative, and each logit by at most that times ``max|logit|``. A greedy token's
logprob is the maximum of log_softmax, which moves by at most ``2 * max|dlogit|``. Hence
``|dlogprob| <= 2 * (2 * L * tp * 2^-8) * max|logit|``. It is compared at every position up to and
including the first position where the greedy tokens differ (a divergence is legitimate only where the
top-2 margin is inside the bound, and then the chosen logprobs still agree within it).
"""
from __future__ import annotations

from reference_impl.truth.stores import TP_SIZES, U_ACCUM, U_BF16

BF16_UNIT_ROUNDOFF = 2.0 ** -8
RELOAD_LOGPROB_TOL = 1e-4


def tp_logprob_bound(num_layers: int, tp: int, max_abs_logit: float) -> float:
    return 2.0 * (2 * num_layers * tp * BF16_UNIT_ROUNDOFF) * max_abs_logit


# ----------------------------------------------------------------------------------------- golden outputs
#: Unit roundoffs of the error model of reference_impl/truth/golden.py: BF16 stores (8 significant bits) and fp32
#: accumulation (one ulp per addition: tensor cores truncate, see reference_impl/bounds/dense.py's U_ACCUM).
GOLDEN_U_BF16 = U_BF16
GOLDEN_U_ACCUM = U_ACCUM
#: Hoeffding multiplier: P(a correct engine's deviation exceeds the bound) <= 2 exp(-LAMBDA^2 / 2) = 3.0e-8
#: per compared quantity, so a full run (~10^4 comparisons) fails falsely with probability < 1e-3.
GOLDEN_LAMBDA = 6.0
GOLDEN_TP_SIZES = TP_SIZES


def golden_bound(variance, tp: int = 1):
    """Bound on ``|engine - golden|`` of a quantity (logprob, logit gap, router-logit gap) with variance
    proxies ``variance[..., (bf16, accum, tp2, tp4, tp8)]`` from :mod:`reference_impl.truth.golden`.

    Derivation. To first order an engine's value differs from the exact one (fp64, no rounding) by
    ``sum_i s_i e_i``, one term per rounding it makes: ``s_i`` is the sensitivity (the reference's exact
    gradient), ``|e_i| <= u c_i`` the rounding's bound (``u = 2^-8`` for a BF16 store, ``2^-23`` for an fp32
    addition; ``c_i`` the magnitude of the rounded quantity: the stored value, the dequantized weight,
    ``sum |x w|`` of a dot product; see the module docstring of reference_impl/truth/golden.py). With rounding
    errors independent and mean zero (Higham and Mary 2019, the model behind probabilistic rounding error
    analysis), Hoeffding's inequality bounds the sum by ``LAMBDA * sqrt(sum_i (u s_i c_i)^2)`` except with
    probability ``2 exp(-LAMBDA^2 / 2)``. The variance proxies are ``sum_i (s_i c_i)^2`` per unit; at TPn the
    ``tpN`` proxy adds each rank's partial sum and the all-reduce's running sums, rounded to BF16 (TP sizes
    other than 2, 4, 8 use the next larger one). The reference's own BF16 path (one such engine) sits at
    about a tenth of this bound on the fixtures (tests/server/test_server_golden.py records the ratio).
    """
    import torch

    from reference_impl.truth.stores import covering_tp

    v = torch.as_tensor(variance, dtype=torch.float64)
    extra = torch.zeros_like(v[..., 0])
    if tp > 1:
        covering = covering_tp(tp)
        if covering is None:
            raise ValueError(f"golden bounds cover tensor parallelism up to {GOLDEN_TP_SIZES[-1]}, got {tp}")
        extra = v[..., 2 + GOLDEN_TP_SIZES.index(covering)]
    return GOLDEN_LAMBDA * torch.sqrt(GOLDEN_U_BF16 ** 2 * (v[..., 0] + extra) + GOLDEN_U_ACCUM ** 2 * v[..., 1])
