"""What the reload scenarios need besides a user's checkpoint, derived into a directory the suite owns
(the user's directory is only ever read):

* weight set ``b``: a different but valid checkpoint of the same model (same names, dtypes, shapes and
  file layout). Every tensor changes, so that a reload which leaves *any* tensor stale is visible: rows of
  every tensor rolled by one (weights, block scales, AWQ scales, norms, embeddings, router), float tensors
  also scaled by 1.25, per-tensor scales (``weight_scale_2``, ``input_scale``) scaled by 1.25;
* ``corrupt``: ``b`` without one tensor of its last layer (a quantized linear's ``weight_scale``), removed
  from its shard and from ``model.safetensors.index.json``.

:func:`verify_corrupt` checks, before a "failed reload" scenario relies on it, that a corrupt checkpoint is
broken in exactly the intended way: ``b`` minus that one tensor, and rejected by the reference loader for
that reason.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

INDEX_FILE = "model.safetensors.index.json"
SCALE_FACTOR = 1.25
_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    return load_file(str(path)), metadata


def _save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)


def different_tensor(t: torch.Tensor) -> torch.Tensor:
    """The ``b`` version of one tensor (same dtype and shape)."""
    if t.numel() <= 1:
        return (t.double() * SCALE_FACTOR).to(t.dtype) if t.dtype in _FLOAT else t.clone()
    out = torch.roll(t, 1, dims=0)
    if t.dtype in _FLOAT:
        out = (out.double() * SCALE_FACTOR).to(t.dtype)
    return out


def _same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    return torch.equal(x.contiguous().reshape(-1).view(torch.uint8), y.contiguous().reshape(-1).view(torch.uint8))


def _copy_other_files(src: Path, dst: Path) -> None:
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != INDEX_FILE:
            shutil.copyfile(f, dst / f.name)
    if (src / INDEX_FILE).is_file():
        shutil.copyfile(src / INDEX_FILE, dst / INDEX_FILE)


def derive_different_weights(src: Path, dst: Path) -> list[str]:
    """Write weight set ``b`` of checkpoint ``src`` into ``dst``; returns the tensors that stayed equal
    (constant tensors whose roll and scaling change nothing; empty for any trained checkpoint)."""
    dst.mkdir(parents=True, exist_ok=False)
    unchanged = []
    for shard in sorted(src.glob("*.safetensors")):
        tensors, metadata = _load(shard)
        new = {name: different_tensor(t) for name, t in tensors.items()}
        unchanged += [n for n in tensors if _same_bytes(tensors[n], new[n])]
        _save(new, dst / shard.name, metadata)
    _copy_other_files(src, dst)
    return sorted(unchanged)


def corrupt_target(names: list[str]) -> str:
    """The tensor a corrupt checkpoint lacks: a ``weight_scale`` of the last layer (a down projection when
    there is one), so a loader that copies tensor by tensor gets almost to the end before failing."""
    layers = [int(m.group(1)) for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n))]
    if not layers:
        raise ValueError("no model.layers.<i>.* tensors: cannot pick a tensor of the last layer")
    last = f"model.layers.{max(layers)}."
    candidates = sorted(n for n in names if n.startswith(last) and n.endswith(".weight_scale"))
    if not candidates:
        candidates = sorted(n for n in names if n.startswith(last))
    down = [n for n in candidates if "down_proj" in n]
    return (down or candidates)[-1]


def derive_corrupt(b: Path, dst: Path, tensor: str | None = None) -> str:
    """Write ``b`` minus one tensor of its last layer into ``dst``; returns the tensor's name."""
    dst.mkdir(parents=True, exist_ok=False)
    shards = {}
    for shard in sorted(b.glob("*.safetensors")):
        from safetensors import safe_open

        with safe_open(str(shard), framework="pt") as f:
            shards[shard] = list(f.keys())
    tensor = tensor or corrupt_target([n for names in shards.values() for n in names])
    for shard, names in shards.items():
        if tensor in names:
            tensors, metadata = _load(shard)
            del tensors[tensor]
            _save(tensors, dst / shard.name, metadata)
        else:
            try:
                os.link(shard, dst / shard.name)  # both in the suite's own directory
            except OSError:
                shutil.copyfile(shard, dst / shard.name)
    _copy_other_files(b, dst)
    index = dst / INDEX_FILE
    if index.is_file():
        data = json.loads(index.read_text())
        data.get("weight_map", {}).pop(tensor, None)
        index.write_text(json.dumps(data, indent=2) + "\n")
    return tensor


def tensor_names(path: str | Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for shard in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            names.update(f.keys())
    return names


def verify_corrupt(b: str, corrupt: str, tensor: str) -> None:
    """Raise AssertionError unless ``corrupt`` is ``b`` minus exactly ``tensor`` and the reference loader
    rejects it for that tensor (so a failed reload fails for the intended reason, not a missing directory
    or an unreadable file)."""
    from reference_impl.model.checkpoint import CheckpointError, load_checkpoint
    from reference_impl.model import validate_checkpoint

    if not Path(corrupt).is_dir():
        raise AssertionError(f"corrupt checkpoint {corrupt!r} does not exist")
    missing, extra = tensor_names(b) - tensor_names(corrupt), tensor_names(corrupt) - tensor_names(b)
    if missing != {tensor} or extra:
        raise AssertionError(f"corrupt checkpoint {corrupt!r} is not {b!r} minus exactly {tensor!r}: "
                             f"missing {sorted(missing)[:5]}, extra {sorted(extra)[:5]}")
    try:
        validate_checkpoint(load_checkpoint(corrupt))
    except CheckpointError as exc:
        if f"missing tensor {tensor!r}" not in str(exc):
            raise AssertionError(f"corrupt checkpoint {corrupt!r} is rejected for another reason: {exc}") from exc
        return
    raise AssertionError(f"corrupt checkpoint {corrupt!r} loads without error: it is not broken")
