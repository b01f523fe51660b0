"""Checkpoint tensors read lazily from the safetensors files (memory-mapped; never all at once), exactly
dequantized on the device that needs them.

* :class:`CheckpointFiles`: the tensor index over every ``*.safetensors`` file of a checkpoint directory; a
  tensor is read when asked for (:meth:`CheckpointFiles.get`); :meth:`CheckpointFiles.lazy` gives
  name -> :class:`LazyTensor` (dtype and shape from the file headers) for validation without reading data;
  :meth:`CheckpointFiles.digest` is :func:`reference_impl.truth.golden.checkpoint_digest` tensor by tensor.
* :class:`DeviceWeights`: the packed tensors on the truth's device, kept there while they fit a byte budget
  (else read again from the files at every use), and :meth:`DeviceWeights.linear` -- the fp64 weight
  ``e2m1 * e4m3 * weight_scale_2 * pre_quant_scale`` (the AWQ scale folded into the columns:
  ``(x * s) @ W^T == x @ (W * s)^T``). Every factor is exact in fp64 (2 + 4 + 24 + 8 significant bits), so
  the weight is the checkpoint's exactly. The fp64 weights themselves are kept too, up to
  :data:`DECODED_KEEP_BYTES` (the small models of the fixtures and self-tests: every forward would decode them
  again; a real checkpoint's fp64 weights, 16x its packed bytes, are mostly made at each use).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from reference_impl.model.checkpoint import CheckpointError
from reference_impl.format.nvfp4 import codes_times_block_scales

_DTYPES = {"U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "BF16": torch.bfloat16,
           "F16": torch.float16, "F32": torch.float32, "F64": torch.float64, "BOOL": torch.bool}


@dataclass(frozen=True)
class LazyTensor:
    """A tensor's dtype and shape; the data are read by :meth:`load` (or the conversions validation uses)."""

    files: "CheckpointFiles"
    name: str
    dtype: torch.dtype
    shape: torch.Size

    def numel(self) -> int:
        return self.shape.numel()

    def load(self) -> torch.Tensor:
        return self.files.get(self.name)

    def float(self) -> torch.Tensor:
        return self.load().float()


class CheckpointFiles:
    def __init__(self, path: str | Path):
        from safetensors import SafetensorError, safe_open

        root = Path(path)
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{root}: no *.safetensors files")
        self.path, self._handles, self._where = str(root), {}, {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt", device="cpu")
            except (SafetensorError, OSError, RuntimeError) as exc:
                raise CheckpointError(f"{f}: cannot read safetensors file ({exc})") from exc
            self._handles[f] = handle
            for name in handle.keys():
                if name in self._where:
                    raise CheckpointError(f"{f}: tensor {name!r} also appears in another file")
                self._where[name] = f

    def names(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        return self._handles[self._where[name]].get_tensor(name)

    def lazy(self) -> dict[str, LazyTensor]:
        out = {}
        for name, f in self._where.items():
            sl = self._handles[f].get_slice(name)
            out[name] = LazyTensor(self, name, _DTYPES[sl.get_dtype()], torch.Size(sl.get_shape()))
        return out

    def digest(self) -> str:
        return _digest(self)


def _digest(files) -> str:
    """sha256 over the sorted tensor names, dtypes, shapes and bytes (reference_impl.truth.golden.checkpoint_digest),
    one tensor in memory at a time."""
    h = hashlib.sha256()
    for name in files.names():
        t = files.get(name).contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


#: fp64 weights kept by :class:`DeviceWeights` (beyond its packed-tensor budget; at most a quarter of it).
#: Small on purpose: the truth's peak device memory grows by at most this over the packed tensors and the
#: layer being computed.
DECODED_KEEP_BYTES = 1 << 30


class DeviceWeights:
    """Checkpoint tensors on ``device``: packed tensors cached within ``budget_bytes``, fp64 weights made on
    demand (and kept while they fit :data:`DECODED_KEEP_BYTES`)."""

    def __init__(self, files: CheckpointFiles, device: torch.device | str, budget_bytes: int):
        self.files, self.device, self.budget = files, torch.device(device), budget_bytes
        self._cache: dict[str, torch.Tensor] = {}
        self.cached_bytes = 0
        self.read_bytes = 0  # bytes read from the files (host) since creation
        self._decoded: dict[str, torch.Tensor] = {}
        self.decoded_bytes = 0
        self._decoded_budget = min(DECODED_KEEP_BYTES, budget_bytes // 4)

    def raw(self, name: str) -> torch.Tensor:
        t = self._cache.get(name)
        if t is not None:
            return t
        cpu = self.files.get(name)
        self.read_bytes += cpu.numel() * cpu.element_size()
        t = cpu.to(self.device, non_blocking=False)
        size = t.numel() * t.element_size()
        if self.cached_bytes + size <= self.budget:
            self._cache[name] = t
            self.cached_bytes += size
        return t

    def has(self, name: str) -> bool:
        return name in self.files

    def tensor64(self, name: str) -> torch.Tensor:
        return self.raw(name).double()

    def is_quantized(self, prefix: str) -> bool:
        return f"{prefix}.weight_scale" in self.files

    def linear(self, prefix: str, rows: slice | None = None) -> torch.Tensor:
        """The fp64 weight ``[N, K]`` of linear ``prefix`` (rows ``rows`` only), AWQ scale folded in. The
        caller must not modify it (a kept weight is returned to every caller)."""
        if rows is not None:
            return self._decode(prefix, rows)
        kept = self._decoded.get(prefix)
        if kept is not None:
            return kept
        out = self._decode(prefix, None)
        size = out.numel() * out.element_size()
        if self.decoded_bytes + size <= self._decoded_budget:
            self._decoded[prefix] = out
            self.decoded_bytes += size
        return out

    def _decode(self, prefix: str, rows: slice | None) -> torch.Tensor:
        w = self.raw(f"{prefix}.weight")
        if w.dtype != torch.uint8:  # excluded from quantization
            return (w if rows is None else w[rows]).double()
        scale = self.raw(f"{prefix}.weight_scale")
        if rows is not None:
            w, scale = w[rows], scale[rows]
        out = codes_times_block_scales(w, scale).double() * self.raw(f"{prefix}.weight_scale_2").double().reshape(())
        pqs = f"{prefix}.pre_quant_scale"
        if ".experts." not in prefix and pqs in self.files:  # MoE experts: no AWQ (as engines)
            out = out * self.raw(pqs).double()[None, :]
        return out


class TranslatedFiles:
    """A checkpoint whose tensors need translating to the ModelOpt layout first (compressed-tensors NVFP4A16:
    other names, encode-convention global scales): read whole through :func:`reference_impl.model.checkpoint.
    load_checkpoint`, then served from memory with :class:`CheckpointFiles`' interface."""

    def __init__(self, path: str | Path):
        from reference_impl.model.checkpoint import load_checkpoint

        self.path = str(path)
        self._tensors = load_checkpoint(path).tensors

    def names(self) -> list[str]:
        return sorted(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def get(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def lazy(self) -> dict[str, LazyTensor]:
        return {n: LazyTensor(self, n, t.dtype, t.shape) for n, t in self._tensors.items()}

    def digest(self) -> str:
        return _digest(self)
