"""The backend under test (``--backend``) against the golden data the suite ships (fixtures/snapshots/): the
canonical dense cases' inputs are rebuilt on the CPU and must hash to the value stored with the golden output;
they are then moved to the backend's device (a ``b200`` backend: the GPU) and the backend's output is judged
against the stored exact value ``exact_fp64`` within the derived dense bound. The truth here is the stored
file, not the reference code of this checkout."""
from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch

from conformance.adapter import Backend, DenseLayer
from conformance.bounds import dense_error_bound, error_figures
from conformance.cases import as_params, case_for_backend
from conformance.dense_cases import DENSE_CASES, build_activations, build_layer
from conformance.golden import CANONICAL, dense_golden_path, inputs_sha256, load_dense_golden
from reference_impl.dense import w4a16_linear_exact

GOLDEN_CASES = [c for c in DENSE_CASES if c.id in CANONICAL]


def _on(layer: DenseLayer, device: torch.device) -> DenseLayer:
    return replace(layer, **{f.name: getattr(layer, f.name).to(device) for f in fields(layer)
                             if isinstance(getattr(layer, f.name), torch.Tensor)})


@pytest.mark.parametrize("case", as_params(GOLDEN_CASES))
def test_dense_matches_golden(backend: Backend, case, record_property) -> None:
    run_case = case_for_backend(case, backend)
    reason = backend.skip_reason(run_case.info())
    if reason:
        pytest.skip(reason)
    golden = load_dense_golden(case.id)
    layer, x = build_layer(case, "cpu"), build_activations(case, "cpu")
    assert inputs_sha256(layer, x) == golden["inputs_sha256"], (
        f"{case.id}: the inputs rebuilt here do not hash to the ones stored in {dense_golden_path(case.id)}: "
        f"the case's input generator changed; regenerate the golden data on purpose (tests/test_dense_snapshots.py)"
    )
    device = run_case.device
    y = backend.run_dense(backend.prepare_dense(_on(layer, device), device), x.to(device))
    exact = golden["exact_fp64"]
    # The bound's scale |x'| @ |W|^T alpha comes from the same inputs; the value judged against is the stored one.
    _, magnitude = w4a16_linear_exact(x, layer.weight, layer.weight_scale, layer.weight_scale_2,
                                      layer.pre_quant_scale, layer.bias)
    bound = dense_error_bound(exact, magnitude, case.k, has_pre_quant_scale=layer.pre_quant_scale is not None,
                              bias=layer.bias)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and tuple(y.shape) == tuple(exact.shape), (
        f"output {getattr(y, 'dtype', type(y))} {tuple(getattr(y, 'shape', ()))}, golden bfloat16 {tuple(exact.shape)}"
    )
    fig = error_figures(y.cpu(), exact, bound)
    for name, value in fig.properties().items():
        record_property(name, value)
    assert fig.bound_ratio <= 1.0, (
        f"{case.id}: output outside the derived bound of the golden value ({dense_golden_path(case.id).name}): "
        f"max |y - y*| / bound = {fig.bound_ratio:.4g} at {fig.worst_index} (got {fig.worst_got!r}, golden "
        f"{fig.worst_exact!r}); rel_l2 {fig.rel_l2:.3g}, cosine {fig.cosine:.6f}"
    )
