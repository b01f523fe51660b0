"""``--server-weights bf16``: the BF16-dequantized copies the suite serves to engines without an NVFP4 kernel
(conformance/server/bf16_copies.py), judged against the NVFP4 originals' golden truth.

* every copied weight is, bit for bit, ``bf16(fp32(e2m1 * e4m3 * weight_scale_2 * pre_quant_scale))``
  computed here independently (nibble table, float8 cast); every other tensor is unchanged;
* the copy of ``corrupt`` is the copy of ``b`` minus exactly the weight of the linear whose scale it lacks;
* a correct engine serving a copy passes the golden comparison with the original's truth: transformers'
  own model classes (an independent implementation) on the copy, fp32 arithmetic from the BF16 weights,
  greedy with logprobs; a copy that drops the AWQ scale (a wrong copy) fails it;
* the catalog serves the copies and takes the truth (and the corrupt-checkpoint check) from the originals.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conformance.server.bf16_copies import STAMP, copy_tensor_name, verify_corrupt_copy, write_bf16_copy
from conformance.interfaces.server_types import Generation
from conformance.server.golden import PROMPTS, compare_with_golden
from conformance.server.models import ModelCatalog
from fixtures.make_checkpoints import ensure_checkpoints
from reference_impl.model.checkpoint import read_tensors

FAMILIES = ("dense-nvfp4_awq", "moe-w4a16_nvfp4")
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


@pytest.fixture(scope="module")
def root() -> Path:
    return ensure_checkpoints()


def independent_bf16(t: dict, prefix: str) -> torch.Tensor:
    packed = t[f"{prefix}.weight"]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()  # low nibble first
    values = E2M1[codes & 7] * torch.where(codes & 8 > 0, -1.0, 1.0).double()
    scales = t[f"{prefix}.weight_scale"].to(torch.float64).repeat_interleave(16, dim=-1)
    w = values * scales * t[f"{prefix}.weight_scale_2"].double()
    if f"{prefix}.pre_quant_scale" in t and ".experts." not in prefix:
        w = w * t[f"{prefix}.pre_quant_scale"].double()[None, :]
    return w.float().bfloat16()


@pytest.mark.parametrize("family", FAMILIES)
def test_copy_is_the_dequantized_checkpoint(root, tmp_path, family):
    src = read_tensors(root / f"{family}-a")
    report = write_bf16_copy(root / f"{family}-a", tmp_path / "a")
    copy = read_tensors(tmp_path / "a")
    quantized = sorted(n[: -len(".weight")] for n, v in src.items() if n.endswith(".weight") and v.dtype == torch.uint8)
    assert report.linears == len(quantized) and not report.dropped
    for prefix in quantized:
        assert copy[f"{prefix}.weight"].dtype == torch.bfloat16
        assert torch.equal(copy[f"{prefix}.weight"].view(torch.int16), independent_bf16(src, prefix).view(torch.int16)), prefix
    plain = {n for n in src if n.rsplit(".", 1)[0] not in quantized}
    assert set(copy) == plain | {f"{p}.weight" for p in quantized}
    for n in plain:
        assert torch.equal(copy[n], src[n]), n
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    assert not (tmp_path / "a" / "hf_quant_config.json").exists()
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (root / f"{family}-a" / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("family", FAMILIES)
def test_corrupt_copy_lacks_exactly_that_linear(root, tmp_path, family):
    from fixtures.make_checkpoints import corrupt_tensor_name, hf_config

    missing = copy_tensor_name(corrupt_tensor_name(family.split("-")[0], hf_config(family.split("-")[0])))
    write_bf16_copy(root / f"{family}-b", tmp_path / "b")
    report = write_bf16_copy(root / f"{family}-corrupt", tmp_path / "corrupt")
    assert report.dropped == (missing,)
    verify_corrupt_copy(str(tmp_path / "b"), str(tmp_path / "corrupt"), missing)
    with pytest.raises(AssertionError, match="minus exactly"):  # the check can fail: b is not a broken b
        verify_corrupt_copy(str(tmp_path / "b"), str(tmp_path / "b"), missing)


def transformers_greedy(path: Path, prompt_ids: list[list[int]], steps: int) -> list[Generation]:
    """Greedy generations with logprobs by transformers' model class on a BF16 checkpoint, fp32 arithmetic."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            seq, lps = list(ids), []
            for _ in range(steps):
                logits = model(torch.tensor([seq])).logits[0, -1].double()
                logprobs = torch.log_softmax(logits, -1)
                token = int(logprobs.argmax())
                seq.append(token)
                lps.append(float(logprobs[token]))
            out.append(Generation("", tuple(seq[len(ids):]), tuple(lps), "length", len(ids)))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_on_the_copy_passes_the_originals_truth(root, tmp_path, family):
    catalog = ModelCatalog([family], str(root), [], None)
    truth = catalog.truth(catalog.served(family), "a")
    write_bf16_copy(root / f"{family}-a", tmp_path / "a")
    outputs = transformers_greedy(tmp_path / "a", truth.golden.prompt_ids, truth.golden.max_new_tokens)
    result = compare_with_golden(outputs, truth, 1, f"transformers on the BF16 copy of {family}-a")
    assert result.compared > 0


def test_copy_without_the_awq_scale_fails_the_truth(root, tmp_path, monkeypatch):
    from conformance.server import bf16_copies

    family = "dense-nvfp4_awq"
    catalog = ModelCatalog([family], str(root), [], None)
    truth = catalog.truth(catalog.served(family), "a")
    real = bf16_copies.dequantized_weight
    monkeypatch.setattr(bf16_copies, "dequantized_weight", lambda t, p: real(
        {k: v for k, v in t.items() if not k.endswith(".pre_quant_scale")}, p))
    write_bf16_copy(root / f"{family}-a", tmp_path / "a")
    outputs = transformers_greedy(tmp_path / "a", truth.golden.prompt_ids, truth.golden.max_new_tokens)
    with pytest.raises(AssertionError, match="reference's golden"):
        compare_with_golden(outputs, truth, 1, "AWQ scale dropped")


def test_catalog_serves_copies_and_judges_by_the_originals(root, tmp_path, monkeypatch):
    monkeypatch.setenv("NVFP4_SERVER_WORK_DIR", str(tmp_path))
    nvfp4 = ModelCatalog(["dense-nvfp4_awq"], str(root), [], None)
    bf16 = ModelCatalog(["dense-nvfp4_awq"], str(root), [], None, "bf16")
    original, served = nvfp4.served("dense-nvfp4_awq"), bf16.served("dense-nvfp4_awq")
    assert served.original == original and served.truth_model == original
    for weight_set in ("a", "b", "corrupt"):
        assert Path(served.path(weight_set)).parent.parent == tmp_path
        assert (Path(served.path(weight_set)) / STAMP).is_file()
    assert served.tokenizer == str(Path(served.a) / "tokenizer.json")
    assert served.corrupt_tensor == "model.layers.1.mlp.down_proj.weight"
    assert bf16.truth(served, "b").path == original.b
