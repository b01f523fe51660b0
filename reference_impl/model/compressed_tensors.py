"""compressed-tensors NVFP4A16 checkpoints (format ``nvfp4-pack-quantized``): read, validate, write.

llm-compressor's ``NVFP4A16`` scheme, as compressed-tensors 0.20 writes it (``NVFP4PackedCompressor``): in
``config.json``, ``quantization_config`` with ``quant_method: compressed-tensors``, ``format:
nvfp4-pack-quantized`` and one config group per target set whose ``weights`` are ``num_bits 4, type float,
strategy tensor_group, group_size 16, symmetric``, ``input_activations: null``; ``ignore`` lists the modules left
in float (names, or ``re:`` regular expressions). Every quantized linear ``<prefix>`` stores

* ``<prefix>.weight_packed``       uint8 ``[N, K/2]``: two E2M1 codes per byte, element 2i in the low nibble
  (compressed-tensors' ``pack_fp4_to_uint8``: ``low | high << 4``), the same bytes as ModelOpt's ``weight``;
* ``<prefix>.weight_scale``        float8_e4m3fn ``[N, K/16]`` (``scale_dtype``), linear layout, as ModelOpt's;
* ``<prefix>.weight_global_scale`` fp32 ``[1]``: the **encode** scale. compressed-tensors dequantizes
  ``w = e2m1 * (e4m3 / weight_global_scale)`` (``dequantize`` divides the group scale by the global scale);
  ModelOpt's ``weight_scale_2`` is the decode scale, ``w = e2m1 * e4m3 * weight_scale_2``. So
  ``weight_scale_2 = 1 / weight_global_scale``.

:func:`to_modelopt` gives the tensors ModelOpt names, ``weight_scale_2 = fp32(1 / weight_global_scale)``: the
decode scale vLLM's compressed-tensors scheme computes (``1.0 / layer.weight_global_scale``) and runs with. The
rounding of that reciprocal changes a tensor's scale by at most 2^-24 relative (half an fp32 ulp), which the
suite's bounds (BF16 outputs, relative 2^-8) absorb; the truth of a compressed-tensors checkpoint is computed
from exactly these tensors, so it equals the truth of :func:`to_modelopt`'s ModelOpt-layout copy bit for bit.
:func:`from_modelopt` is the inverse (``weight_global_scale = fp32(1 / weight_scale_2)``): writing ModelOpt
tensors through it and reading back gives the ModelOpt tensors again whenever the reciprocal round-trips.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

QUANT_METHOD = "compressed-tensors"
FORMAT = "nvfp4-pack-quantized"
GROUP_SIZE = 16
#: compressed-tensors name -> ModelOpt name, for the tensors of a quantized linear
_RENAMES = {"weight_packed": "weight", "weight_scale": "weight_scale"}
_GLOBAL = "weight_global_scale"


def is_compressed_tensors(quantization_config: dict | None) -> bool:
    return isinstance(quantization_config, dict) and quantization_config.get("quant_method") == QUANT_METHOD


def validate_config(q: dict, source: str, error: type[Exception]) -> list[str]:
    """Check that ``q`` (config.json's ``quantization_config``) is a compressed-tensors NVFP4A16 checkpoint the
    reference can serve; returns its ``ignore`` list. Raises ``error`` naming what is not NVFP4A16."""
    def fail(what: str):
        raise error(f"{source}: compressed-tensors {what} (the reference reads NVFP4A16: format {FORMAT}, "
                    f"4-bit float weights in 16-element groups with a tensor-wide global scale, BF16 activations)")

    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        fail(f"quantization_status {status!r} is not 'compressed' (the weights are not packed)")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        fail("config without config_groups")
    for name, group in groups.items():
        fmt = group.get("format") or q.get("format")
        if fmt != FORMAT:
            fail(f"config group {name!r} has format {fmt!r}")
        w = group.get("weights") or {}
        got = (w.get("num_bits"), w.get("type"), w.get("strategy"), w.get("group_size"), w.get("symmetric", True))
        if got != (4, "float", "tensor_group", GROUP_SIZE, True):
            fail(f"config group {name!r} has weights {w!r}")
        if w.get("scale_dtype") not in (None, "torch.float8_e4m3fn", "float8_e4m3fn"):
            fail(f"config group {name!r} has scale_dtype {w.get('scale_dtype')!r}, not float8_e4m3fn")
        if group.get("input_activations") is not None:
            fail(f"config group {name!r} quantizes input activations (NVFP4 W4A4 is not NVFP4A16)")
        if not set(group.get("targets") or []) <= {"Linear"}:
            fail(f"config group {name!r} targets {group.get('targets')!r}; only Linear layers are modelled")
    ignore = q.get("ignore", [])
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        fail(f"ignore {ignore!r} is not a list of module names")
    return ignore


def excluded_modules(ignore: list[str], tensor_names: set[str]) -> list[str]:
    """The module names ``ignore`` selects among the checkpoint's modules (``re:`` entries are regular
    expressions matched from the start of the module name, ``re.match``, as compressed-tensors matches them)."""
    modules = {n.rsplit(".", 1)[0] for n in tensor_names}
    out = []
    for entry in ignore:
        if entry.startswith("re:"):
            pattern = re.compile(entry[3:])
            out += sorted(m for m in modules if pattern.match(m))
        else:
            out.append(entry)
    return sorted(set(out))


def to_modelopt(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same checkpoint under ModelOpt's tensor names and decode-scale convention (see the module docstring).
    Tensors that are not part of a quantized linear keep their names."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        prefix, _, suffix = name.rpartition(".")
        if suffix == _GLOBAL:
            if t.numel() != 1:
                raise ValueError(f"{name}: a tensor-wide global scale has one element, got shape {list(t.shape)}")
            out[f"{prefix}.weight_scale_2"] = (1.0 / t.float()).to(torch.float32).reshape(())
        elif suffix in _RENAMES and f"{prefix}.weight_packed" in tensors:
            out[f"{prefix}.{_RENAMES[suffix]}"] = t
        else:  # also a scale whose packed weight is missing: validation names the missing weight
            out[name] = t
    return out


def from_modelopt(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ModelOpt-layout tensors (W4A16: ``input_scale`` / ``pre_quant_scale`` are not part of NVFP4A16 and are
    refused) under compressed-tensors' names, ``weight_global_scale = fp32(1 / weight_scale_2)``, shape [1]."""
    quantized = {n.rsplit(".", 1)[0] for n in tensors if n.endswith(".weight_scale_2")}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        prefix, _, suffix = name.rpartition(".")
        if prefix in quantized:
            if suffix in ("input_scale", "pre_quant_scale"):
                raise ValueError(f"{name}: NVFP4A16 has no {suffix} (activations stay BF16, no AWQ)")
            if suffix == "weight":
                out[f"{prefix}.weight_packed"] = t
            elif suffix == "weight_scale_2":
                out[f"{prefix}.{_GLOBAL}"] = (1.0 / t.float()).to(torch.float32).reshape(1)
            else:
                out[name] = t
        else:
            out[name] = t
    return out


def quantization_config(ignore: list[str]) -> dict:
    """``config.json``'s ``quantization_config`` for NVFP4A16 (the fields compressed-tensors 0.20 writes)."""
    weights = {"dynamic": False, "group_size": GROUP_SIZE, "num_bits": 4, "scale_dtype": "torch.float8_e4m3fn",
               "strategy": "tensor_group", "symmetric": True, "type": "float"}
    return {"config_groups": {"group_0": {"format": FORMAT, "input_activations": None, "output_activations": None,
                                          "targets": ["Linear"], "weights": weights}},
            "format": FORMAT, "ignore": list(ignore), "kv_cache_scheme": None, "quant_method": QUANT_METHOD,
            "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {}}


def save(path: str | Path, hf_config: dict, tensors: dict[str, torch.Tensor], ignore: list[str]) -> None:
    """Write a compressed-tensors NVFP4A16 checkpoint from ModelOpt-layout W4A16 tensors."""
    from safetensors.torch import save_file

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    config["quantization_config"] = quantization_config(ignore)
    (root / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    ct = from_modelopt(tensors)
    save_file({k: v.contiguous() for k, v in sorted(ct.items())}, str(root / "model.safetensors"),
              metadata={"format": "pt"})
