"""Real ModelOpt exports (tests/reference/modelopt_exporter.py, made at test time with nvidia-modelopt on CPU): the reference
reads what ModelOpt writes as transformers does, refuses what it cannot serve with a clear error, and the
scenario suite runs on such a checkpoint with its own tokenizer and with ``--tokenizer``, leaving the directory
byte for byte as it was.

What a ModelOpt 0.47.0 export holds that the fixtures do not (each exercised here): ``pre_quant_scale`` only on
``o_proj`` (the AWQ scales of q/k/v, gate/up and down are folded into the RMSNorm weights and ``up_proj``); no
``input_scale`` under W4A16_NVFP4; no ``lm_head.weight`` when the embeddings are tied; ``rope_parameters``
instead of ``rope_theta``; ``num_local_experts``; sharded files with an index; ``kv_cache_quant_algo`` with
``k_scale`` / ``v_scale`` tensors; float16 tensors when the model was float16; no tokenizer files.
"""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

# find_spec, not importorskip: importing ModelOpt takes ~8 s (it imports its vLLM and transformers plugins),
# which every xdist worker would pay at collection; the tests import it when they export
pytestmark = [
    pytest.mark.integration,  # starts servers or whole pytest runs (ci/time_tests.py times them apart)
    pytest.mark.skipif(importlib.util.find_spec("modelopt") is None,
                       reason="needs nvidia-modelopt (installed by ci/install-test-deps.sh)"),
]
pytest.importorskip("transformers", reason="needs transformers (the [test] extra, ci/install-test-deps.sh)")

from tests.reference import byo_exporter, modelopt_exporter  # noqa: E402
from tests.reference.test_byo_checkpoint import _state, assert_suite_passes_and_leaves_checkpoint_untouched  # noqa: E402
from tests.reference.test_checkpoints import assert_matches_transformers  # noqa: E402

EXPORTS = {  # name: (arch, algo, options)
    "llama-nvfp4_awq-sharded": ("llama", "NVFP4_AWQ", {"shard_size": "200KB"}),
    "llama-w4a16_nvfp4-tied": ("llama", "W4A16_NVFP4", {"tied": True}),
    "qwen3_moe-w4a16_nvfp4": ("qwen3_moe", "W4A16_NVFP4", {}),
    "qwen3_moe-nvfp4": ("qwen3_moe", "NVFP4", {}),
}


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("modelopt")
    out = {name: modelopt_exporter.export(base / name, arch, algo, **opts) for name, (arch, algo, opts) in EXPORTS.items()}
    out["tokenizer"] = byo_exporter.write_tokenizer(base / "tokenizer", modelopt_exporter.VOCAB).parent
    return out


def _names(path: Path) -> set[str]:
    from conformance.server.derive import tensor_names

    return tensor_names(path)


def test_what_modelopt_writes(exports):
    """The features of real exports the reader must handle are present (if ModelOpt stops writing them, the
    tests below no longer exercise them and this says so)."""
    awq = _names(exports["llama-nvfp4_awq-sharded"])
    assert {n for n in awq if n.endswith("pre_quant_scale")} == {f"model.layers.{i}.self_attn.o_proj.pre_quant_scale"
                                                                 for i in range(modelopt_exporter.LAYERS)}
    assert (exports["llama-nvfp4_awq-sharded"] / "model.safetensors.index.json").is_file()
    assert not any(n.endswith("input_scale") for n in _names(exports["qwen3_moe-w4a16_nvfp4"]))
    assert "lm_head.weight" not in _names(exports["llama-w4a16_nvfp4-tied"])
    assert not any((p / "tokenizer.json").exists() for k, p in exports.items() if k != "tokenizer")


@pytest.mark.parametrize("name", EXPORTS)
def test_reference_reads_real_exports_as_transformers_does(exports, name):
    """Our exact model on the export vs transformers' own model class loaded with the export's float64-dequantized
    weights (bound derived in tests/reference/test_checkpoints.py; these weights are drawn at 0.1, 1.6 times the
    1/sqrt(fan_in) scale that derivation assumes, and measured errors are a tenth of the bound). A misread AWQ
    fold, tied head, rotary base or expert layout moves logits by O(0.1)."""
    from reference_impl.model.checkpoint import load_checkpoint

    assert_matches_transformers(load_checkpoint(exports[name]), name)


@pytest.mark.parametrize("options,message", [
    ({"fp8_kv": True}, "kv_cache_quant_algo 'FP8'"),
    ({"dtype": torch.float16}, "unquantized tensors are float16"),
], ids=["fp8-kv-cache", "float16"])
def test_unservable_exports_are_clear_errors_at_start(tmp_path, options, message):
    from conformance.server.models import ModelCatalog, ModelError

    path = modelopt_exporter.export(tmp_path / "ckpt", "llama", "W4A16_NVFP4", **options)
    tok = byo_exporter.write_tokenizer(tmp_path / "tok", modelopt_exporter.VOCAB)
    with pytest.raises(ModelError, match=f"cannot be served by the reference: .*{message}"):
        ModelCatalog([], None, [str(path)], str(tok)).check_user_checkpoints()


def test_derived_weight_sets_of_a_real_moe_export(exports, tmp_path):
    """Weight set b and the corrupt checkpoint derive from a real MoE export (the scenario runs below are dense:
    a MoE run costs about 200 s of CI time, mostly the reference's golden outputs and near-tie branches)."""
    from conformance.server.derive import derive_corrupt, derive_different_weights, verify_corrupt
    from reference_impl.model.checkpoint import load_checkpoint
    from reference_impl.model import validate_checkpoint

    src = exports["qwen3_moe-w4a16_nvfp4"]
    before = _state(src)
    assert derive_different_weights(src, tmp_path / "b") == []
    validate_checkpoint(load_checkpoint(tmp_path / "b"))
    tensor = derive_corrupt(tmp_path / "b", tmp_path / "corrupt")
    verify_corrupt(str(tmp_path / "b"), str(tmp_path / "corrupt"), tensor)
    assert _state(src) == before


@pytest.mark.parametrize("name,variant", [("llama-nvfp4_awq-sharded", "own-tokenizer"),
                                          ("llama-w4a16_nvfp4-tied", "tokenizer-option")])
def test_scenarios_on_a_real_modelopt_export(exports, tmp_path, name, variant):
    """Every TP1 scenario passes (none skipped) on the export and its directory is left exactly as it was; the
    sharded export is also offered every damage class (derived from its b across shards and its index)."""
    ckpt = exports[name]
    extra = ["--tokenizer", str(exports["tokenizer"])]
    if variant == "own-tokenizer":
        ckpt = tmp_path / name
        shutil.copytree(exports[name], ckpt)
        shutil.copyfile(exports["tokenizer"] / "tokenizer.json", ckpt / "tokenizer.json")
        extra = []
    assert_suite_passes_and_leaves_checkpoint_untouched(tmp_path, ckpt, extra, damage_classes=name.endswith("-sharded"))
