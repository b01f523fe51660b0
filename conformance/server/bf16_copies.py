"""BF16-dequantized copies of NVFP4 checkpoints, for engines that cannot run NVFP4 on the hardware at hand
(``--server-weights bf16``; e.g. vLLM on CPU, which has no NVFP4 kernel there).

The suite serves the copies and judges against the NVFP4 originals: every weight set of a served model
(``a``, ``b``, ``corrupt``) is copied, reloads point at the copies of the same weight sets, and the golden
truth stays the originals' (conformance/server/models.py, ``ServedModel.original``).

A copy of checkpoint ``src`` holds, for every quantized linear ``<p>``, one BF16 ``<p>.weight``:
``bf16(fp32(e2m1 * e4m3 * weight_scale_2 * pre_quant_scale))`` with the AWQ ``pre_quant_scale`` folded
into the weight's columns (dense linears only: the reference and engines apply none to MoE experts), and
every other tensor unchanged (they are BF16 already). ``config.json`` loses its ``quantization_config``,
``hf_quant_config.json`` is not copied; the tokenizer and generation files are.

Why the golden bound still holds (conformance/server/bounds.golden_bound, reference_impl/golden._Store): an
engine serving NVFP4 with a BF16 GEMM stores ``w = W * weight_scale_2`` in BF16, and the bound already
gives each weight element ``(n, k)`` the term ``u * |w_nk| * sum_t |g_tn| |x'_tk|`` (``x' = x *
pre_quant_scale``). The copy rounds ``w_nk * s_k`` instead; its error ``|e| <= u |w_nk s_k|`` reaches the
output as ``x_tk e_nk``, at most ``u |x'_tk| |w_nk|``: the same term. The copy does not round ``x * s``
(that term of the bound is then unused). ``e2m1 * e4m3`` is exact and the product is formed in fp64, then
rounded to fp32 and to BF16 as a GPU engine's dequantization does (relative error ``<= 2^-8 (1 + 2^-15)``).

A linear whose quantized tensors are incomplete (the ``corrupt`` weight set lacks one ``weight_scale``)
cannot be dequantized: its copy has no ``<p>.weight`` at all, so the copy of ``corrupt`` is the copy of
``b`` minus exactly that tensor, and the failed-reload scenario tests the same thing on the copies.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from reference_impl.model.checkpoint import CONFIG, HF_QUANT_CONFIG
from reference_impl.format.nvfp4 import codes_times_block_scales

INDEX_FILE = "model.safetensors.index.json"
QUANT_FIELDS = ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale")
STAMP = "bf16_copy.json"  # written last: a directory without it is an interrupted copy


@dataclass(frozen=True)
class CopyReport:
    linears: int               # quantized linears dequantized
    dropped: tuple[str, ...]   # ``<p>.weight`` left out: the linear lacked a tensor it needs


def dequantized_weight(tensors: dict[str, torch.Tensor], prefix: str) -> torch.Tensor | None:
    """The BF16 weight of quantized linear ``prefix`` (AWQ scale folded), or None if a tensor is missing."""
    packed, scales, ws2 = (tensors.get(f"{prefix}.{f}") for f in ("weight", "weight_scale", "weight_scale_2"))
    if packed is None or scales is None or ws2 is None:
        return None
    w = codes_times_block_scales(packed, scales).double() * ws2.double().reshape(())
    pqs = tensors.get(f"{prefix}.pre_quant_scale") if ".experts." not in prefix else None
    if pqs is not None:
        w = w * pqs.double().reshape(1, -1)
    return w.float().to(torch.bfloat16)


def _quantized_prefixes(tensors: dict[str, torch.Tensor]) -> set[str]:
    out = {n[: -len(".weight")] for n, t in tensors.items() if n.endswith(".weight") and t.dtype == torch.uint8}
    for n in tensors:
        for f in QUANT_FIELDS:
            if n.endswith(f".{f}"):
                out.add(n[: -len(f) - 1])
    return out


def bf16_tensors(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], CopyReport]:
    """The copy's tensors of one checkpoint's (or shard's) tensors."""
    prefixes = _quantized_prefixes(tensors)
    out, dropped = {}, []
    for name, t in tensors.items():
        prefix = name.rsplit(".", 1)[0]
        if prefix not in prefixes:
            out[name] = t
    for prefix in sorted(prefixes):
        w = dequantized_weight(tensors, prefix)
        if w is None:
            dropped.append(f"{prefix}.weight")
        else:
            out[f"{prefix}.weight"] = w
    return out, CopyReport(len(prefixes) - len(dropped), tuple(dropped))


def write_bf16_copy(src: str | Path, dst: str | Path) -> CopyReport:
    """Write the BF16 copy of checkpoint directory ``src`` into ``dst`` (which must not exist). The whole
    checkpoint is read at once (a linear's tensors may lie in different shards); one file is written."""
    from safetensors.torch import save_file

    from reference_impl.model.checkpoint import read_tensors

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=False)
    tensors, report = bf16_tensors(read_tensors(src))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((src / CONFIG).read_text())
    config.pop("quantization_config", None)
    config["torch_dtype"] = "bfloat16"
    (dst / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in (CONFIG, HF_QUANT_CONFIG, INDEX_FILE) and not f.name.endswith(".safetensors"):
            shutil.copyfile(f, dst / f.name)
    (dst / STAMP).write_text(json.dumps({"source": str(src), "linears": report.linears,
                                         "dropped": list(report.dropped)}, indent=2) + "\n")
    return report


def copy_tensor_name(original_tensor: str) -> str:
    """The tensor a copy lacks when its original lacks ``original_tensor``: the linear's BF16 weight."""
    prefix, _, field = original_tensor.rpartition(".")
    if field in QUANT_FIELDS[:2] or field == "weight":
        return f"{prefix}.weight"
    return original_tensor


def verify_corrupt_copy(b_copy: str, corrupt_copy: str, tensor: str) -> None:
    """Raise AssertionError unless ``corrupt_copy`` is ``b_copy`` minus exactly ``tensor``, every other
    tensor byte for byte the same (the copies' side of conformance.server.derive.verify_corrupt)."""
    from reference_impl.model.checkpoint import read_tensors

    b, c = read_tensors(b_copy), read_tensors(corrupt_copy)
    missing, extra = set(b) - set(c), set(c) - set(b)
    if missing != {tensor} or extra:
        raise AssertionError(f"BF16 copy {corrupt_copy!r} is not {b_copy!r} minus exactly {tensor!r}: "
                             f"missing {sorted(missing)[:5]}, extra {sorted(extra)[:5]}")
    changed = [n for n in c if not torch.equal(c[n].contiguous().reshape(-1).view(torch.uint8),
                                               b[n].contiguous().reshape(-1).view(torch.uint8))]
    if changed:
        raise AssertionError(f"BF16 copy {corrupt_copy!r} differs from {b_copy!r} in {changed[:5]}")
