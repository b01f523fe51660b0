"""The golden data the suite ships (fixtures/snapshots/, written by the self-tests with ``--snapshot-update``) and
how a conformance test finds it: which dense cases have a golden snapshot, where it is, and the hash that ties
it to the case's inputs (so a changed input generator cannot be judged against stale golden values)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .adapter import DenseLayer
from .snapshots import load_snapshot, snapshot_root, tensors_sha256

#: Dense cases with a stored golden output (``tests/test_dense_snapshots.py`` writes them).
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
