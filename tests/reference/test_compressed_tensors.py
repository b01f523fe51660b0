"""compressed-tensors NVFP4A16 checkpoints (reference_impl/model/compressed_tensors.py) against compressed-tensors' own
code (the independent oracle, ``compressed-tensors==0.20.0``, ci/requirements-sglang.txt): packing and nibble
order, the value rounding of its compressor, the reader's decoded weights, the writer's bytes, the reciprocal
global-scale convention (a named case with a mutant reader that takes the encode scale for a decode scale), and
the acceptance: a tiny Llama written by compressed-tensors itself passes the scenario suite through
``--server-checkpoint`` and its golden truth equals that of the same weights in ModelOpt layout."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ct = pytest.importorskip("compressed_tensors", reason="needs compressed-tensors (ci/install-test-deps.sh)")

from reference_impl.model import compressed_tensors as C  # noqa: E402
from reference_impl.model.checkpoint import CheckpointError, load_checkpoint  # noqa: E402
from reference_impl.format.nvfp4 import E2M1_MAGNITUDES, e2m1_decode, e2m1_encode, e4m3_decode, pack_nibbles, unpack_nibbles  # noqa: E402
from tests.reference import ct_exporter  # noqa: E402
from tests.reference.modelopt_exporter import LAYERS  # noqa: E402
from tests.reference.compressed_tensors_mutants import MUTANT_READERS  # noqa: E402

# |ours - CT| for a decoded weight: CT computes fp32(e2m1 * fp32(e4m3 / g)) (two roundings), the reader decodes
# e2m1 * e4m3 * fp32(1 / g) exactly in fp64 (one rounding, in fp32(1/g)): at most (1 + 2^-24)^3 - 1 < 4 * 2^-24
# relative, per element.
DECODE_REL_BOUND = 4 * 2.0**-24


@pytest.fixture(scope="module")
def ct_export(tmp_path_factory) -> Path:
    return ct_exporter.export(tmp_path_factory.mktemp("ct") / "llama-nvfp4a16")


def _ct_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _prefixes(tensors) -> list[str]:
    return sorted(n.removesuffix(".weight_packed") for n in tensors if n.endswith(".weight_packed"))


def _ct_decompress(tensors: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """compressed-tensors' own decompression of one linear: the calls NVFP4PackedCompressor.decompress makes
    (unpack_fp4_from_uint8, then dequantize with the group scale and the global scale), in float32 instead of
    its default bfloat16 so that the comparison sees the scales' convention, not a final BF16 rounding."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    packed = tensors[f"{prefix}.weight_packed"]
    m, n = packed.shape
    codes = unpack_fp4_from_uint8(packed, m, n * 2, dtype=torch.float32)
    weight = dequantize(x_q=codes, scale=tensors[f"{prefix}.weight_scale"].to(torch.float32),
                        args=preset_name_to_scheme("NVFP4A16", ["Linear"]).weights,
                        global_scale=tensors[f"{prefix}.weight_global_scale"], dtype=torch.float32)
    return weight.double()


def _reader_decode(modelopt: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    codes = e2m1_decode(unpack_nibbles(modelopt[f"{prefix}.weight"])).double()
    scales = e4m3_decode(modelopt[f"{prefix}.weight_scale"]).double().repeat_interleave(16, -1)
    return codes * scales * modelopt[f"{prefix}.weight_scale_2"].double()


# --------------------------------------------------------------------------------- format, against CT's code
def test_packing_and_nibble_order_match_compressed_tensors():
    """Every pair of E2M1 codes packs to the byte compressed-tensors' pack_fp4_to_uint8 gives (element 2i in
    the low nibble), and its unpack gives our values back."""
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8

    codes = torch.cartesian_prod(torch.arange(16), torch.arange(16)).to(torch.uint8).reshape(1, -1)
    values = e2m1_decode(codes)
    values[codes == 8] = -0.0
    ours = pack_nibbles(codes)
    theirs = pack_fp4_to_uint8(values)
    assert torch.equal(ours, theirs)
    assert torch.equal(unpack_fp4_from_uint8(theirs, 1, codes.shape[1], dtype=torch.float32), values)


def test_compressor_rounds_values_as_the_reference_does():
    """compressed-tensors' compressor (quantize + pack) on a weight, with its own scales, gives the bytes the
    reference's E2M1 rounding packs from ``w / (e4m3 / g)`` (ties, saturation and signs included), except the
    sign of zero: compressed-tensors writes -0.0 as code 0 (+0), the reference keeps the sign bit (code 8);
    both decode to zero, so no product differs."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 256, generator=g) * 0.05).bfloat16()
    # exact E2M1 midpoints and saturating values, relative to each row's first group maximum
    w[0, :16] = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -5, 6.5, 0, -0.0, 1, -6]) * 0.05
    gs = generate_gparam(w.float().amin(), w.float().amax())
    groups = w.float().reshape(64, 16, 16)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=gs)
    theirs = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": gs}, scheme)
    effective = (scale.float() / gs.float()).repeat_interleave(16, -1)  # CT's fp32 division, per element
    ours = pack_nibbles(e2m1_encode((w.float() / effective).clamp(-6, 6)))
    assert theirs["weight_scale"].dtype == torch.float8_e4m3fn
    t, o = unpack_nibbles(theirs["weight_packed"]), unpack_nibbles(ours)
    differ = t != o
    negative_zero = (w.float() == 0) & torch.signbit(w.float())
    assert torch.equal(differ, negative_zero & (o == 8)), "codes differ beyond the sign of zero"
    assert bool((t[differ] == 0).all()) and int(differ.sum()) == 1


def test_what_compressed_tensors_writes(ct_export):
    """The export holds what the reader handles (if compressed-tensors changes it, this says so)."""
    q = json.loads((ct_export / "config.json").read_text())["quantization_config"]
    assert (q["quant_method"], q["format"], q["quantization_status"], q["ignore"]) == (
        "compressed-tensors", "nvfp4-pack-quantized", "compressed", ["lm_head"])
    t = _ct_tensors(ct_export)
    p = _prefixes(t)[0]
    assert t[f"{p}.weight_packed"].dtype == torch.uint8
    assert t[f"{p}.weight_scale"].dtype == torch.float8_e4m3fn
    assert t[f"{p}.weight_global_scale"].dtype == torch.float32 and t[f"{p}.weight_global_scale"].shape == (1,)
    assert t["lm_head.weight"].dtype == torch.bfloat16 and "lm_head.weight_packed" not in t
    assert len(_prefixes(t)) == 7 * LAYERS  # q, k, v, o, gate, up, down per layer


def test_reader_decodes_what_compressed_tensors_decompresses(ct_export):
    tensors = _ct_tensors(ct_export)
    modelopt = load_checkpoint(ct_export).tensors
    worst = 0.0
    for prefix in _prefixes(tensors):
        want, got = _ct_decompress(tensors, prefix), _reader_decode(modelopt, prefix)
        worst = max(worst, float(((got - want).abs() / want.abs().clamp(min=1e-30)).max()))
    assert worst <= DECODE_REL_BOUND, f"decoded weights differ by {worst:.3g} relative (bound {DECODE_REL_BOUND:.3g})"


def test_writer_reproduces_compressed_tensors_bytes(ct_export, tmp_path):
    """Reading the export and writing it back gives compressed-tensors' bytes for the packed weights and group
    scales; the global scales survive the double reciprocal exactly where fp32 round-trips it (both counted)."""
    ckpt = load_checkpoint(ct_export)
    C.save(tmp_path / "rewritten", ckpt.hf_config, ckpt.tensors, ["lm_head"])
    original, rewritten = _ct_tensors(ct_export), _ct_tensors(tmp_path / "rewritten")
    assert original.keys() == rewritten.keys()
    exact = off = 0
    for name, t in original.items():
        if name.endswith(".weight_global_scale"):
            if torch.equal(t, rewritten[name]):
                exact += 1
            else:  # one fp32 ulp at most: fp32(1 / fp32(1 / g))
                assert float((rewritten[name] - t).abs() / t) <= 2.0**-23, name
                off += 1
        else:
            assert t.dtype == rewritten[name].dtype and torch.equal(_bytes(t), _bytes(rewritten[name])), name
    assert exact + off == len(_prefixes(original))
    again = load_checkpoint(tmp_path / "rewritten")
    assert json.loads((tmp_path / "rewritten" / "config.json").read_text())["quantization_config"]["format"] == C.FORMAT
    assert again.quant == ckpt.quant


# --------------------------------------------------------------------------------- the reciprocal convention
@dataclass(frozen=True)
class CTCase:
    """A named convention of the format: the reader's decoded weights must match compressed-tensors'."""

    id: str
    global_scale: float  # weight_global_scale written (the encode scale); 1.0 would hide the convention
    tier: str = "cpu"


CT_CASES = [
    CTCase("global-scale-is-the-encode-scale", 2688.0 / 0.37),
    CTCase("global-scale-below-one", 0.125),
]


def _one_linear(tmp_path: Path, case: CTCase) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (32, 64), generator=g, dtype=torch.uint8)
    scales = torch.tensor([0.5, 1.0, 2.0, 448.0]).repeat(32, 1).to(torch.float8_e4m3fn)
    p = "model.layers.0.mlp.down_proj"
    tensors = {f"{p}.weight_packed": pack_nibbles(codes), f"{p}.weight_scale": scales,
               f"{p}.weight_global_scale": torch.tensor([case.global_scale], dtype=torch.float32)}
    from safetensors.torch import save_file

    d = tmp_path / case.id
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": C.quantization_config([])}))
    return d, tensors


def _decode_error(reader, d: Path, tensors) -> float:
    p = "model.layers.0.mlp.down_proj"
    want = _ct_decompress(tensors, p)
    got = _reader_decode(reader(d), p)
    return float(((got - want).abs() / want.abs().clamp(min=1e-30)).max())


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CT_CASES])
def test_reciprocal_global_scale_convention(tmp_path, case):
    d, tensors = _one_linear(tmp_path, case)
    assert _decode_error(lambda path: load_checkpoint(path).tensors, d, tensors) <= DECODE_REL_BOUND


@pytest.mark.parametrize("mutant", sorted(MUTANT_READERS))
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CT_CASES])
def test_mutant_reader_is_caught(tmp_path, case, mutant):
    d, tensors = _one_linear(tmp_path, case)
    assert _decode_error(MUTANT_READERS[mutant], d, tensors) > DECODE_REL_BOUND


# --------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("change, message", [
    (lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 4, "type": "float"}),
     "quantizes input activations"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=32), "has weights"),
    (lambda q: q["config_groups"]["group_0"].update(format="pack-quantized"), "has format 'pack-quantized'"),
    (lambda q: q.update(quantization_status="frozen"), "quantization_status 'frozen'"),
])
def test_unservable_compressed_tensors_configs_are_clear_errors(ct_export, tmp_path, change, message):
    d = tmp_path / "bad"
    shutil.copytree(ct_export, d)
    config = json.loads((d / "config.json").read_text())
    change(config["quantization_config"])
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(d)


def test_a_missing_packed_weight_is_named(ct_export, tmp_path):
    from safetensors.torch import save_file

    from reference_impl.model import validate_checkpoint

    d = tmp_path / "missing"
    shutil.copytree(ct_export, d)
    t = _ct_tensors(d)
    name = _prefixes(t)[-1] + ".weight_packed"
    del t[name]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensor"):
        validate_checkpoint(load_checkpoint(d))


def test_a_global_scale_of_several_elements_is_named(ct_export, tmp_path):
    from safetensors.torch import save_file

    d = tmp_path / "wide-global"
    shutil.copytree(ct_export, d)
    t = _ct_tensors(d)
    name = _prefixes(t)[0] + ".weight_global_scale"
    t[name] = t[name].repeat(2)
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"{name}: a tensor-wide global scale has one element"):
        load_checkpoint(d)
