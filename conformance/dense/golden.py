"""The golden data the suite ships (fixtures/snapshots/, written by the self-tests with ``--snapshot-update``) and
how a conformance test finds it: which dense cases have a golden snapshot, where it is, and the hash that ties
it to the case's inputs (so a changed input generator cannot be judged against stale golden values)."""
from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from reference_impl.dense import w4a16_linear_exact

from conformance.interfaces.kernel import Backend, DenseLayer
from reference_impl.bounds.dense import ErrorFigures, dense_error_bound, error_figures
from conformance._framework.cases import case_for_backend
from conformance.dense.cases import DenseCase, build_activations, build_layer
from conformance._framework.snapshots import load_snapshot, snapshot_root, tensors_sha256

#: Dense cases with a stored golden output (``tests/dense/test_dense_snapshots.py`` writes them).
CANONICAL = ("cpu-k48-mult16-not64", "cpu-fused-qkv-3-scales", "cpu-awq-bias-3d")
DENSE_GOLDEN_MODULE = "test_dense_snapshots"
DENSE_GOLDEN_TEST = "test_dense_reference_golden"


def inputs_sha256(layer: DenseLayer, x: torch.Tensor) -> str:
    """The hash a dense golden snapshot records for its inputs (checkpoint tensors, then the activations)."""
    return tensors_sha256((layer.weight, layer.weight_scale, layer.weight_scale_2, layer.input_scale,
                           layer.pre_quant_scale, layer.bias, x.contiguous()))


def dense_golden_path(case_id: str) -> Path:
    return snapshot_root() / DENSE_GOLDEN_MODULE / f"{DENSE_GOLDEN_TEST}[{case_id}].tensors.json"


def load_dense_golden(case_id: str) -> dict[str, Any]:
    """The stored entries of ``case_id``'s golden snapshot (``exact_fp64``, ``reference_bf16``, ``inputs_sha256``...)."""
    return load_snapshot(dense_golden_path(case_id))


def _on(layer: DenseLayer, device: torch.device) -> DenseLayer:
    return replace(layer, **{f.name: getattr(layer, f.name).to(device) for f in fields(layer)
                             if isinstance(getattr(layer, f.name), torch.Tensor)})


def check_dense_golden(backend: Backend, case: DenseCase) -> ErrorFigures:
    """Rebuild ``case``'s inputs on the CPU, require them to hash to the stored ``inputs_sha256``, run the backend
    on its tier's device and require every element within the derived dense bound of the stored ``exact_fp64``.
    Returns the figures; raises ``AssertionError`` with a readable report."""
    golden = load_dense_golden(case.id)
    layer, x = build_layer(case, "cpu"), build_activations(case, "cpu")
    assert inputs_sha256(layer, x) == golden["inputs_sha256"], (
        f"{case.id}: the inputs rebuilt here do not hash to the ones stored in {dense_golden_path(case.id)}: "
        f"the case's input generator changed; regenerate the golden data on purpose (tests/dense/test_dense_snapshots.py)"
    )
    device = case_for_backend(case, backend).device
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
    assert fig.bound_ratio <= 1.0, (
        f"{case.id}: output outside the derived bound of the golden value ({dense_golden_path(case.id).name}): "
        f"max |y - y*| / bound = {fig.bound_ratio:.4g} at {fig.worst_index} (got {fig.worst_got!r}, golden "
        f"{fig.worst_exact!r}); rel_l2 {fig.rel_l2:.3g}, cosine {fig.cosine:.6f}"
    )
    return fig
