"""The self-test environment is complete: the independent oracles and the real engine code that other
self-tests use (and skip without, to stay runnable piecemeal) must be importable here. Run
`bash ci/install-test-deps.sh` when this fails."""
import importlib


def test_flashinfer_cpu_quantizer_model_importable():
    importlib.import_module("flashinfer.batch_invariant.quantization.nvfp4_reference")


def test_ml_dtypes_has_the_nvfp4_formats():
    ml_dtypes = importlib.import_module("ml_dtypes")
    assert hasattr(ml_dtypes, "float4_e2m1fn") and hasattr(ml_dtypes, "float8_e4m3fn")


def test_sglang_layer_code_importable():
    from conformance.adapters.sglang._import import import_sglang_module

    for module in (
        "sglang.srt.layers.quantization.modelopt_quant",
        "sglang.srt.arg_groups.moe_hook",
        "sglang.srt.layers.logits_processor",
        "sglang.srt.layers.moe.moe_runner.flashinfer_cutedsl",
        "sglang.srt.models.deepseek_v2",
        "sglang.srt.models.qwen3_5",
    ):
        import_sglang_module(module)


def test_modelopt_quantizer_installed_with_its_cpu_dependencies():
    """nvidia-modelopt 0.47.0 (the ModelOpt-recipe oracle) and what its quantizer import needs. Checked without
    importing ModelOpt (a ~10 s import, paid once by tests/reference/test_nvfp4_oracles.py)."""
    from importlib.metadata import files, version
    from importlib.util import find_spec

    from conformance.format.oracles import MODELOPT_VERSION

    assert version("nvidia-modelopt") == MODELOPT_VERSION
    assert any(str(f) == "modelopt/torch/quantization/qtensor/nvfp4_tensor.py" for f in files("nvidia-modelopt"))
    missing = [m for m in ("omegaconf", "pulp", "scipy", "pydantic", "regex", "rich", "yaml", "requests", "huggingface_hub") if find_spec(m) is None]
    assert not missing, f"missing ModelOpt import dependencies {missing}: pip install -r ci/requirements-modelopt-cpu.txt"
