"""Tolerances of the server scenarios, each with its derivation.

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

BF16_UNIT_ROUNDOFF = 2.0 ** -8
RELOAD_LOGPROB_TOL = 1e-4


def tp_logprob_bound(num_layers: int, tp: int, max_abs_logit: float) -> float:
    return 2.0 * (2 * num_layers * tp * BF16_UNIT_ROUNDOFF) * max_abs_logit
