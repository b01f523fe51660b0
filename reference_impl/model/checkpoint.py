"""ModelOpt NVFP4 checkpoints in Hugging Face layout (docs/contracts.md section 7): read, validate, write.

A checkpoint directory holds ``config.json`` (the Hugging Face model config, optionally with a flat
``quantization_config``), optionally ``hf_quant_config.json`` (the nested ModelOpt form) and one or more
``*.safetensors`` files. Every quantized linear ``<prefix>`` stores

* ``<prefix>.weight``          uint8 ``[N, K/2]`` (two E2M1 codes per byte, element 2i in the low nibble)
* ``<prefix>.weight_scale``    float8_e4m3fn ``[N, K/16]`` (linear layout)
* ``<prefix>.weight_scale_2``  fp32 scalar (decode scale: ``w = e2m1 * e4m3 * weight_scale_2``)
* ``<prefix>.input_scale``     fp32 scalar (W4A4 activation scale; required for NVFP4/NVFP4_AWQ, optional
  for W4A16_NVFP4, never used by W4A16 math)
* ``<prefix>.pre_quant_scale`` ``[K]`` (NVFP4_AWQ only, optional: ModelOpt folds it into the preceding
  RMSNorm weight or linear where it can -- q/k/v, gate/up, down -- and keeps it only where it cannot, e.g.
  ``o_proj`` under grouped-query attention; an absent scale is the identity, as engines initialise it)

Excluded modules (``exclude_modules`` / ``ignore``, with ``*`` wildcards) keep a plain float ``.weight``.
compressed-tensors NVFP4A16 checkpoints (``quant_method: compressed-tensors``, ``nvfp4-pack-quantized``) are read
as W4A16_NVFP4, their tensors renamed and their encode global scales inverted by
:mod:`reference_impl.model.compressed_tensors`.
Every malformed input raises :class:`CheckpointError` naming the file or the tensor.
"""
from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from reference_impl.model import compressed_tensors
from reference_impl.format.nvfp4 import BLOCK_SIZE

QUANT_ALGOS = ("NVFP4", "NVFP4_AWQ", "W4A16_NVFP4")
GROUP_SIZE = BLOCK_SIZE
HF_QUANT_CONFIG = "hf_quant_config.json"
CONFIG = "config.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be served: the message names the file or tensor and what is wrong."""


@dataclass(frozen=True)
class QuantConfig:
    quant_algo: str
    group_size: int = GROUP_SIZE
    exclude_modules: tuple[str, ...] = ()
    kv_cache_quant_algo: str | None = None  # ModelOpt's KV-cache quantization (e.g. "FP8"); None: BF16 KV cache

    @property
    def is_awq(self) -> bool:
        return self.quant_algo == "NVFP4_AWQ"

    @property
    def requires_input_scale(self) -> bool:
        return self.quant_algo != "W4A16_NVFP4"

    def is_excluded(self, prefix: str) -> bool:
        """True if ``prefix`` (a module name) matches an exclude pattern (exact, wildcard or a parent)."""
        for pattern in self.exclude_modules:
            if fnmatch.fnmatchcase(prefix, pattern) or prefix.startswith(pattern + "."):
                return True
        return False

    def as_hf_quant_config(self) -> dict:
        return {
            "producer": {"name": "nvfp4-w4a16-conformance fixtures", "version": "1"},
            "quantization": {
                "quant_algo": self.quant_algo,
                "group_size": self.group_size,
                "exclude_modules": list(self.exclude_modules),
            },
        }

    def as_flat_quantization_config(self) -> dict:
        return {
            "quant_method": "modelopt",
            "quant_algo": self.quant_algo,
            "group_size": self.group_size,
            "ignore": list(self.exclude_modules),
        }


def _validated_quant_config(algo, group_size, exclude, source: str, kv_cache_algo=None) -> QuantConfig:
    if algo not in QUANT_ALGOS:
        raise CheckpointError(f"{source}: quant_algo {algo!r} is not one of {', '.join(QUANT_ALGOS)}")
    if group_size is None:
        group_size = GROUP_SIZE
    if group_size != GROUP_SIZE:
        raise CheckpointError(f"{source}: group_size {group_size!r} is not {GROUP_SIZE} (NVFP4 blocks are 16 wide)")
    if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
        raise CheckpointError(f"{source}: exclude_modules/ignore must be a list of strings, got {exclude!r}")
    if kv_cache_algo is not None and not isinstance(kv_cache_algo, str):
        raise CheckpointError(f"{source}: kv_cache_quant_algo must be a string or null, got {kv_cache_algo!r}")
    return QuantConfig(algo, group_size, tuple(exclude), kv_cache_algo)


def _read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def read_configs(path: str | os.PathLike) -> tuple[dict, QuantConfig]:
    """The Hugging Face config dict and the quantization config of checkpoint directory ``path``.
    ``hf_quant_config.json`` (nested) wins over ``config.json``'s flat ``quantization_config``."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {str(root)!r} does not exist")
    if not (root / CONFIG).is_file():
        raise CheckpointError(f"{root}: missing {CONFIG}")
    hf_config = _read_json(root / CONFIG)
    nested = root / HF_QUANT_CONFIG
    if nested.is_file():
        q = _read_json(nested).get("quantization")
        if not isinstance(q, dict) or "quant_algo" not in q:
            raise CheckpointError(f"{nested}: missing 'quantization.quant_algo'")
        quant = _validated_quant_config(q["quant_algo"], q.get("group_size"), q.get("exclude_modules", []), str(nested),
                                        q.get("kv_cache_quant_algo"))
    elif compressed_tensors.is_compressed_tensors(hf_config.get("quantization_config")):
        quant = _compressed_tensors_quant_config(root, hf_config["quantization_config"])
    else:
        q = hf_config.get("quantization_config")
        if not isinstance(q, dict) or "quant_algo" not in q:
            raise CheckpointError(f"{root}: no {HF_QUANT_CONFIG} and no quantization_config.quant_algo in {CONFIG}")
        if q.get("quant_method", "modelopt") != "modelopt":
            raise CheckpointError(f"{root / CONFIG}: quant_method {q.get('quant_method')!r} is not 'modelopt'")
        exclude = q.get("ignore", q.get("exclude_modules", []))
        # ModelOpt's flat form names KV-cache quantization ``kv_cache_scheme`` (compressed-tensors style)
        kv = q.get("kv_cache_quant_algo") or ("FP8" if q.get("kv_cache_scheme") else None)
        quant = _validated_quant_config(q["quant_algo"], q.get("group_size"), exclude, str(root / CONFIG), kv)
    return hf_config, quant


def _compressed_tensors_quant_config(root: Path, q: dict) -> QuantConfig:
    """A compressed-tensors NVFP4A16 checkpoint is W4A16_NVFP4 with its ``ignore`` modules excluded
    (reference_impl/model/compressed_tensors.py)."""
    from safetensors import safe_open

    ignore = compressed_tensors.validate_config(q, str(root / CONFIG), CheckpointError)
    names: set[str] = set()
    for f in sorted(root.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as handle:
                names.update(handle.keys())
        except Exception as exc:  # noqa: BLE001 - read_tensors reports the unreadable file the same way
            raise CheckpointError(f"{f}: cannot read safetensors file ({exc})") from exc
    kv = "FP8" if q.get("kv_cache_scheme") else None
    return _validated_quant_config("W4A16_NVFP4", GROUP_SIZE, compressed_tensors.excluded_modules(ignore, names),
                                   str(root / CONFIG), kv)


def read_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of the ``*.safetensors`` files in ``path``; a name in two files is an error."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(path)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            part = load_file(str(f))
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise CheckpointError(f"{f}: cannot read safetensors file ({exc})") from exc
        dup = tensors.keys() & part.keys()
        if dup:
            raise CheckpointError(f"{f}: tensor {sorted(dup)[0]!r} also appears in another file")
        tensors.update(part)
    return tensors


# ----------------------------------------------------------------------------------------- validation
@dataclass(frozen=True)
class TensorSpec:
    """What a checkpoint must hold under ``name``: dtype and shape (``()`` for a scalar; a 1-element
    tensor is accepted for scalars, as exporters write either)."""

    name: str
    dtype: torch.dtype | tuple[torch.dtype, ...]  # a tuple: any of them
    shape: tuple[int, ...]
    required: bool = True


def linear_specs(prefix: str, out_features: int, in_features: int, quant: QuantConfig,
                 float_dtype: torch.dtype = torch.bfloat16, awq_applies: bool = True) -> list[TensorSpec]:
    """The tensors of linear ``prefix`` ([out, in]) under ``quant``: NVFP4 unless excluded. ``awq_applies``
    False (MoE experts) means no ``pre_quant_scale`` is expected even under NVFP4_AWQ."""
    if quant.is_excluded(prefix):
        return [TensorSpec(f"{prefix}.weight", float_dtype, (out_features, in_features))]
    if in_features % GROUP_SIZE:
        raise CheckpointError(f"{prefix}: in_features {in_features} is not a multiple of {GROUP_SIZE}")
    specs = [
        TensorSpec(f"{prefix}.weight", torch.uint8, (out_features, in_features // 2)),
        TensorSpec(f"{prefix}.weight_scale", torch.float8_e4m3fn, (out_features, in_features // GROUP_SIZE)),
        TensorSpec(f"{prefix}.weight_scale_2", torch.float32, ()),
        TensorSpec(f"{prefix}.input_scale", torch.float32, (), required=quant.requires_input_scale),
    ]
    if quant.is_awq and awq_applies:  # optional: ModelOpt folds it into the preceding norm or linear where it can
        specs.append(TensorSpec(f"{prefix}.pre_quant_scale", float_dtype, (in_features,), required=False))
    return specs


def check_tensors(tensors: dict[str, torch.Tensor], specs: list[TensorSpec], source: str = "checkpoint") -> None:
    """Raise :class:`CheckpointError` for the first missing tensor, wrong dtype, wrong shape or
    non-finite/non-positive global scale."""
    for spec in specs:
        t = tensors.get(spec.name)
        if t is None:
            if spec.required:
                raise CheckpointError(f"{source}: missing tensor {spec.name!r}")
            continue
        allowed = spec.dtype if isinstance(spec.dtype, tuple) else (spec.dtype,)
        if t.dtype not in allowed:
            raise CheckpointError(f"{source}: tensor {spec.name!r} has dtype {t.dtype}, expected "
                                  f"{' or '.join(str(d) for d in allowed)}")
        shape_ok = tuple(t.shape) == spec.shape or (spec.shape == () and t.numel() == 1)
        if not shape_ok:
            raise CheckpointError(
                f"{source}: tensor {spec.name!r} has shape {tuple(t.shape)}, expected {spec.shape}")
        if spec.name.endswith((".weight_scale_2", ".input_scale", ".pre_quant_scale")):
            v = t.float()
            if not bool(torch.isfinite(v).all()) or not bool((v > 0).all()):
                raise CheckpointError(f"{source}: tensor {spec.name!r} must be finite and positive, got {v.flatten()[:4].tolist()}")
        elif spec.name.endswith(".weight_scale") and t.dtype == torch.float8_e4m3fn:
            # E4M3 block scales: NaN (bytes 0x7f, 0xff) or negative ones are never written by an exporter (a
            # block's scale is its amax / 6 >= 0); served, a NaN scale turns its block's outputs into NaN
            v = t.float()
            bad = ~torch.isfinite(v) | (v < 0)
            if bool(bad.any()):
                where = tuple(int(i) for i in bad.nonzero()[0])
                byte = int(t.view(torch.uint8)[where])
                raise CheckpointError(f"{source}: tensor {spec.name!r} holds {int(bad.sum())} block scale(s) that are "
                                      f"NaN or negative (first at index {list(where)}: byte 0x{byte:02x} = "
                                      f"{float(v[where])}); an E4M3 block scale must be finite and >= 0")


@dataclass
class Checkpoint:
    """A loaded checkpoint: the HF config, the quantization config and the raw tensors."""

    path: str
    hf_config: dict
    quant: QuantConfig
    tensors: dict[str, torch.Tensor] = field(repr=False)


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read configs and tensors (no model-specific validation: see :func:`check_tensors`)."""
    hf_config, quant = read_configs(path)
    tensors = read_tensors(path)
    if compressed_tensors.is_compressed_tensors(hf_config.get("quantization_config")) and not (
            Path(path) / HF_QUANT_CONFIG).is_file():
        try:
            tensors = compressed_tensors.to_modelopt(tensors)  # compressed-tensors names and encode scales
        except ValueError as exc:
            raise CheckpointError(f"{path}: {exc}") from exc
    return Checkpoint(str(path), hf_config, quant, tensors)


# ----------------------------------------------------------------------------------------- writing
def save_checkpoint(path: str | os.PathLike, hf_config: dict, quant: QuantConfig, tensors: dict[str, torch.Tensor],
                    *, nested_config: bool = True, flat_config: bool = True, extra_files: dict[str, str] | None = None) -> None:
    """Write a checkpoint directory: ``model.safetensors``, ``config.json`` (with the flat
    ``quantization_config`` when ``flat_config``) and ``hf_quant_config.json`` when ``nested_config``."""
    from safetensors.torch import save_file

    if not (nested_config or flat_config):
        raise ValueError("a checkpoint needs at least one of the nested or flat quantization configs")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    config = dict(hf_config)
    config.pop("quantization_config", None)
    if flat_config:
        config["quantization_config"] = quant.as_flat_quantization_config()
    (root / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if nested_config:
        (root / HF_QUANT_CONFIG).write_text(json.dumps(quant.as_hf_quant_config(), indent=2, sort_keys=True) + "\n")
    contiguous = {k: v.contiguous() for k, v in sorted(tensors.items())}
    save_file(contiguous, str(root / "model.safetensors"), metadata={"format": "pt"})
    for name, text in (extra_files or {}).items():
        (root / name).write_text(text)
