"""Golden snapshots of the dense reference on canonical cases (fixtures/snapshots/), so that a change to
the reference math, the case inputs or the quantizer is noticed. Regenerate with ``--snapshot-update`` only
after explaining the change."""
from __future__ import annotations

import pytest

from reference_impl.bounds.dense import U_FP32, gamma
from conformance.dense.cases import CPU_CASES, build_activations, build_layer
from conformance.testing import Approx
from conformance.dense.golden import CANONICAL, inputs_sha256
from reference_impl.dense import w4a16_linear, w4a16_linear_exact


@pytest.mark.cpu
@pytest.mark.parametrize("case", [c for c in CPU_CASES if c.id in CANONICAL], ids=lambda c: c.id)
def test_dense_reference_golden(case, golden):
    layer, x = build_layer(case), build_activations(case)
    exact, magnitude = w4a16_linear_exact(
        x, layer.weight, layer.weight_scale, layer.weight_scale_2, layer.pre_quant_scale, layer.bias
    )
    y = w4a16_linear(x, layer.weight, layer.weight_scale, layer.weight_scale_2, layer.pre_quant_scale, layer.bias)
    a_max = float(magnitude.max())
    fp64_atol = 2 * gamma(case.k + 2, 2.0**-53) * a_max
    fp32_atol = 2 * gamma(case.k + 2, U_FP32) * a_max
    assert golden == {
        "case": repr(case),
        "inputs_sha256": inputs_sha256(layer, x),
        "exact_fp64": Approx(exact, rtol=0.0, atol=fp64_atol, why=(
            "y* sums K exact products in fp64 (plus alpha and bias): any two summation orders differ by at most "
            "2 gamma_{K+2}(2^-53) max(|x'| @ |W|^T alpha)")),
        "reference_bf16": Approx(y, rtol=2.0**-7, atol=fp32_atol, why=(
            "two fp32-accumulating references differ by <= 2 gamma_{K+2}(2^-24) max(A) before rounding; rounding "
            "to bf16 may then split them across one bf16 ulp (<= 2^-7 |y|)")),
    }


# ----------------------------------------------------------------------------------------- golden check can fail
def test_golden_check_accepts_the_reference_and_rejects_a_mutant():
    """conformance/dense/test_dense_golden.py's check: the reference backend is within the bound of the stored values,
    a backend reading the nibbles swapped is not."""
    from conformance.adapters.reference.kernel import ReferenceBackend
    from conformance.dense.golden import check_dense_golden
    from tests.dense.mutants import NibbleSwapped

    for case in (c for c in CPU_CASES if c.id in CANONICAL):
        assert check_dense_golden(ReferenceBackend(), case).bound_ratio <= 1.0
        with pytest.raises(AssertionError, match="outside the derived bound of the golden value"):
            check_dense_golden(NibbleSwapped(), case)


def test_golden_check_judges_against_the_stored_file(tmp_path, monkeypatch):
    """A stored value that is wrong fails the reference (the file is the truth), and inputs that no longer hash
    to the stored ones are refused with the reason."""
    import json
    import shutil

    from conformance.adapters.reference.kernel import ReferenceBackend
    from conformance.dense.golden import DENSE_GOLDEN_MODULE, check_dense_golden, dense_golden_path

    case = next(c for c in CPU_CASES if c.id == CANONICAL[0])
    shutil.copytree(dense_golden_path(case.id).parent, tmp_path / DENSE_GOLDEN_MODULE)
    monkeypatch.setenv("NVFP4_SNAPSHOT_DIR", str(tmp_path))
    path = dense_golden_path(case.id)
    data = json.loads(path.read_text())
    exact = data["entries"]["exact_fp64"]
    line = exact["hex"][0]  # little-endian fp64: byte 7 holds the sign bit of the first value; flip it
    exact["hex"][0] = line[:14] + f"{int(line[14:16], 16) ^ 0x80:02x}" + line[16:]
    path.write_text(json.dumps(data))
    with pytest.raises(AssertionError, match="outside the derived bound of the golden value"):
        check_dense_golden(ReferenceBackend(), case)
    data["entries"]["inputs_sha256"]["value"] = "0" * 64
    path.write_text(json.dumps(data))
    with pytest.raises(AssertionError, match="do not hash to the ones stored"):
        check_dense_golden(ReferenceBackend(), case)
