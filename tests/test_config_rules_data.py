"""The rule matrices in fixtures/config_rules/ are up to date, complete products, and say what SPEC 4-6 say
on the points the upstream review found wrong."""
from __future__ import annotations

import itertools
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.engines.matrix import MATRICES, load_matrix

ROOT = Path(__file__).resolve().parents[1]


def test_generated_files_are_up_to_date():
    done = subprocess.run([sys.executable, "fixtures/config_rules/generate.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("matrix", MATRICES)
def test_matrix_is_the_full_product(matrix):
    import json

    data = json.loads((ROOT / "fixtures" / "config_rules" / f"{matrix}.json").read_text())
    axes = data["axes"]
    cases = load_matrix(matrix)
    assert len(cases) == math.prod(len(v) for v in axes.values())
    seen = {tuple(c.inputs[a] for a in axes) for c in cases}
    assert seen == set(itertools.product(*axes.values()))
    assert len({c.id for c in cases}) == len(cases)
    for c in cases:
        assert c.expected["kind"] in ("ok", "raises", "rejected_earlier"), c.id


def _case(matrix, **inputs):
    (hit,) = [c for c in load_matrix(matrix) if all(c.inputs[k] == v for k, v in inputs.items())]
    return hit.expected


def test_w4a16_dense_needs_env_and_cutedsl():
    for c in load_matrix("dense"):
        if c.inputs["quant_algo"] in ("NVFP4", "NVFP4_AWQ"):
            resolved = c.inputs["fp4_backend"] == "flashinfer_cutedsl" or (
                c.inputs["fp4_backend"] == "auto" and c.inputs["platform"] == "sm100")
            want = "w4a16" if (c.inputs["w4a16"] == "1" and resolved) else "w4a4"
            assert c.expected["value"]["quant_mode"] == want, c.id


def test_w4a16_flashinfer_a2a_never_auto_enables_nvfp4_dispatch():
    hit = _case("a2a", a2a="flashinfer", w4a16="1", nvfp4_dispatch="unset", dispatch_type="none",
                runner="flashinfer_cutedsl", quantization="modelopt_fp4")
    assert hit == {"kind": "ok", "value": {"dispatch": "bf16"}}
    old = _case("a2a", a2a="flashinfer", w4a16="unset", nvfp4_dispatch="unset", dispatch_type="none",
                runner="flashinfer_cutedsl", quantization="modelopt_fp4")
    assert old == {"kind": "ok", "value": {"dispatch": "nvfp4"}}


@pytest.mark.parametrize("dispatch_type", ["auto", "nvfp4"])
def test_w4a16_rejects_nvfp4_dispatch_types(dispatch_type):
    hit = _case("a2a", a2a="flashinfer", w4a16="1", nvfp4_dispatch="unset", dispatch_type=dispatch_type,
                runner="flashinfer_cutedsl", quantization="modelopt_fp4")
    assert hit["kind"] == "raises" and hit["exc"] == "ValueError"


def test_deepep_rejects_w4a16():
    hit = _case("moe", a2a="deepep", deepep_mode="low_latency", runner="flashinfer_cutedsl", w4a16="1")
    assert hit["kind"] == "raises" and hit["exc"] == "ValueError"


def test_fusions_only_under_w4a4():
    for c in load_matrix("fusion"):
        if c.inputs["gate_up"] != "nvfp4_w4a4":
            assert c.expected["value"] == {"enabled": False}, c.id
