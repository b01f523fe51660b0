"""The rule matrices in fixtures/config_rules/ are up to date, complete products (less the declared
exclusions), their rules profiles name their sources, and they say what docs/contracts.md sections 4-6 say on the points the
upstream review found wrong."""
from __future__ import annotations

import itertools
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.rules.matrix import MATRICES, load_matrix, load_profile, profile_names

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("generator", ["generate.py", "generate_vllm.py"])
def test_generated_files_are_up_to_date(generator):
    done = subprocess.run([sys.executable, f"fixtures/config_rules/{generator}", "--check"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("matrix", MATRICES)
def test_matrix_is_the_full_product(matrix):
    import json

    data = json.loads((ROOT / "fixtures" / "config_rules" / f"{matrix}.json").read_text())
    axes = data["axes"]
    cases = load_matrix(matrix)
    product = set(itertools.product(*axes.values()))
    excluded = {combo for combo in product for ex in data.get("excluded", [])
                if all(combo[list(axes).index(k)] == v for k, v in ex["when"].items())}
    assert all(ex["reason"] for ex in data.get("excluded", []))
    assert len(cases) == math.prod(len(v) for v in axes.values()) - len(excluded)
    seen = {tuple(c.inputs[a] for a in axes) for c in cases}
    assert seen == product - excluded
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


@pytest.mark.parametrize("profile", profile_names())
def test_profile_names_its_sources_and_overrides_real_cases(profile):
    data = load_profile(profile)
    assert data["profile"] == profile and data["engine"] and data["checked_against"]
    for src in data["sources"]:  # read at a commit of a repository, or in a released package
        assert src["file"] and src["tests"] and (
            (src.get("repo") and len(src.get("commit", "")) == 40) or src.get("release")), src
    ids = {m: {c.id for c in load_matrix(m)} for m in MATRICES}
    for matrix, overrides in data["overrides"].items():
        assert set(overrides) <= ids[matrix], (matrix, set(overrides) - ids[matrix])
    if profile != "sglang-0.5.23":
        assert data["sources"], "a profile other than the default must say where its rules come from"
        # it changes the default's outcomes, or models matrices of its own (another engine's rules)
        assert data["overrides"] or data.get("matrices"), "a profile must say what it changes or models"
    for matrix in data.get("matrices", []):
        assert profile in load_matrix(matrix)[0].profiles, (profile, matrix)


def test_main_profile_accepts_w4a16_under_deepep_normal_and_picks_b12x_on_sm12x():
    (normal,) = [c for c in load_matrix("moe") if c.id == "deepep-normal-flashinfer_cutedsl-w4a16=1"]
    assert normal.expected_for("sglang-0.5.23")["kind"] == "rejected_earlier"
    assert normal.expected_for("sglang-main") == {"kind": "ok", "value": {"quant_mode": "w4a16"}}
    for c in load_matrix("fp4_backend"):
        if c.inputs["fp4_backend"] == "auto" and c.inputs["platform"] in ("sm120", "sm121"):
            assert c.expected_for("sglang-0.5.23")["value"] == {"backend": "flashinfer_cutlass"}
            assert c.expected_for("sglang-main")["value"] == {"backend": "flashinfer_b12x"}


def test_w4a16_moe_activations_stay_bf16_and_per_token_is_forced_off():
    for c in load_matrix("moe_activation"):
        if c.inputs["w4a16"] == "1":
            value = c.expected["value"]
            assert (value["activations"], value["x_sf"], value["per_token_scale"], value["fc2_input_scale"]) == (
                "bf16", False, False, False), c.id
    prefill = _case("moe_activation", quantization="modelopt_fp4", w4a16="0", per_token="0", dispatch="flashinfer_prefill")
    assert prefill["value"]["activations"] == "nvfp4_static" and prefill["value"]["combine"] == "standard"


def test_w4a16_never_dispatches_fp4():
    for c in load_matrix("fp4_dispatch"):
        if c.inputs["runner"] == "flashinfer_cutedsl" and c.inputs["w4a16"] == "1":
            assert c.expected["value"] == {"dispatch_fp4": False}, c.id


def test_fp4_checkpoints_select_modelopt_fp4_and_w4a16_mixed_selects_the_mixed_method():
    for c in load_matrix("quant_method"):
        algo = c.inputs["quant_algo"]
        if algo in ("NVFP4", "NVFP4_AWQ", "FP4", "W4A16_NVFP4"):
            assert c.expected["value"]["quant_method"] == "modelopt_fp4", c.id
        if algo == "MIXED_PRECISION_W4A16":
            assert c.expected["value"]["quant_method"] == "modelopt_mixed", c.id
    for c in load_matrix("mixed_layers"):
        if c.inputs["module"] == "lm_head":
            assert c.expected["value"]["quant_algo"] == c.inputs["format"], c.id


def test_vllm_w4a16_rules_restate_the_refusals():
    """vLLM 0.32: VLLM_BATCH_INVARIANT refuses W4A16 on every GPU (CUTLASS where it exists, else emulation, neither
    a W4A16 kernel); auto picks CuTe DSL W4A16 only on SM100/103, Humming (when installed) before Marlin on SM90;
    a W4A16 MoE layer never gets a FlashInfer backend."""
    for c in load_matrix("vllm_linear"):
        want = c.expected_for("vllm-0.32")
        if c.inputs["batch_invariant"] == "1":
            assert want["kind"] == "raises" and "does not support W4A16" in want["match"].replace("\\", ""), c.id
        elif c.inputs["linear_backend"] == "auto":
            kernel = {"sm100": "FlashInferCuteDslNvFp4W4A16LinearKernel", "sm103": "FlashInferCuteDslNvFp4W4A16LinearKernel",
                      "sm90": "HummingNvFp4LinearKernel" if c.inputs["humming"] == "installed" else "MarlinNvFp4LinearKernel"
                      }.get(c.inputs["platform"], "MarlinNvFp4LinearKernel")
            assert want == {"kind": "ok", "value": {"kernel": kernel}}, c.id
    for c in load_matrix("vllm_moe"):
        want = c.expected_for("vllm-0.32")
        assert want["kind"] == "raises" or want["value"]["backend"] in ("MARLIN", "HUMMING"), c.id
        with pytest.raises(LookupError, match="does not model"):
            c.expected_for("sglang-0.5.23")
