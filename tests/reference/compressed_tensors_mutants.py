"""compressed-tensors NVFP4A16 readers that get the global-scale convention wrong; each must fail
tests/reference/test_compressed_tensors.py::test_mutant_reader_is_caught. A reader returns ModelOpt-layout tensors."""
from __future__ import annotations

from pathlib import Path

import torch


def _read(path: Path) -> dict[str, torch.Tensor]:
    from reference_impl.model.checkpoint import read_tensors

    return read_tensors(path)


def global_scale_as_decode_scale(path: Path) -> dict[str, torch.Tensor]:
    """Takes ``weight_global_scale`` (the encode scale) for ModelOpt's ``weight_scale_2`` (the decode scale)."""
    out = {}
    for name, t in _read(path).items():
        prefix, _, suffix = name.rpartition(".")
        if suffix == "weight_global_scale":
            out[f"{prefix}.weight_scale_2"] = t.float().reshape(())
        else:
            out[f"{prefix}.weight" if suffix == "weight_packed" else name] = t
    return out


def global_scale_ignored(path: Path) -> dict[str, torch.Tensor]:
    """Drops the global scale (decode scale 1), as a reader of per-group-only FP4 formats would."""
    out = global_scale_as_decode_scale(path)
    return {k: (torch.tensor(1.0) if k.endswith(".weight_scale_2") else v) for k, v in out.items()}


MUTANT_READERS = {"global_scale_as_decode_scale": global_scale_as_decode_scale,
                  "global_scale_ignored": global_scale_ignored}
