"""A compressed-tensors NVFP4A16 tiny Llama written by compressed-tensors itself (tests/reference/ct_exporter.py, at test
time) passes the scenario suite through ``--server-checkpoint`` (the reference server and the truth both read it
through reference_impl's checkpoint layer), leaving its directory as it was, and its golden truth equals, bit for
bit, the truth of the same weights written in ModelOpt layout (``weight``, ``weight_scale``, ``weight_scale_2 =
1 / weight_global_scale``)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration  # starts servers or whole pytest runs (ci/time_tests.py times them apart)

pytest.importorskip("compressed_tensors", reason="needs compressed-tensors (ci/install-test-deps.sh)")
pytest.importorskip("transformers", reason="needs transformers (the [test] extra, ci/install-test-deps.sh)")

from tests.reference import byo_exporter, ct_exporter, modelopt_exporter  # noqa: E402
from tests.reference.test_byo_checkpoint import assert_suite_passes_and_leaves_checkpoint_untouched  # noqa: E402


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("ct-llama")
    return {"ckpt": ct_exporter.export(base / "llama-nvfp4a16"),
            "tokenizer": byo_exporter.write_tokenizer(base / "tokenizer", modelopt_exporter.VOCAB).parent}


def test_scenarios_on_a_compressed_tensors_export(export, tmp_path):
    """Every TP1 scenario passes (none skipped) and the directory is left exactly as it was."""
    assert_suite_passes_and_leaves_checkpoint_untouched(tmp_path, export["ckpt"], ["--tokenizer", str(export["tokenizer"])])


def test_golden_truth_equals_the_modelopt_layout(export, tmp_path):
    from reference_impl.model.checkpoint import QuantConfig, load_checkpoint, save_checkpoint
    from reference_impl.truth.golden import ExactModel

    ckpt = load_checkpoint(export["ckpt"])
    assert ckpt.quant == QuantConfig("W4A16_NVFP4", 16, ("lm_head",), None)
    modelopt = tmp_path / "modelopt-layout"
    save_checkpoint(modelopt, {k: v for k, v in ckpt.hf_config.items() if k != "quantization_config"}, ckpt.quant,
                    ckpt.tensors)
    prompts = [[1, 5, 9, 17], [1, 40, 2, 77, 3, 100]]
    a = ExactModel(str(export["ckpt"])).golden(prompts, 4)
    b = ExactModel(str(modelopt)).golden(prompts, 4)
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        assert same, f"golden {field.name} differs between the compressed-tensors and the ModelOpt layout"
