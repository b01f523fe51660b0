"""A planted bug for the reporting/gating self-tests (tests/framework/test_reports.py): a dense backend that forgets
the weight decode scale ``weight_scale_2`` (alpha = 1), the kind of integration slip the gate must catch.
Outputs come out about ``1 / weight_scale_2`` (~10^2..10^4) times too large, far outside any derived bound."""
from __future__ import annotations

import torch

from conformance.adapters.reference.kernel import ReferenceBackend
from reference_impl.dense import w4a16_linear


class NoDecodeScaleMutant(ReferenceBackend):
    """The reference layer with ``weight_scale_2`` replaced by ones."""

    name = "NoDecodeScaleMutant"

    def version(self) -> str:
        return "mutant (alpha = 1) of " + super().version()

    def run_dense(self, prepared, x: torch.Tensor) -> torch.Tensor:
        layer = prepared.layer  # the checkpoint tensors the reference keeps next to its decoded weight
        return w4a16_linear(
            x,
            layer.weight,
            layer.weight_scale,
            torch.ones_like(layer.weight_scale_2),
            pre_quant_scale=layer.pre_quant_scale,
            bias=layer.bias,
        )
