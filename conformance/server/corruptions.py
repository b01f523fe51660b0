"""The corrupt checkpoints the failed-reload scenarios offer the engine under test, one per class of damage a
real checkpoint arrives with (issue 37; unloaded or garbage scales used silently is a recurring engine bug
class: vLLM issues 54444, 45212).

Each class damages one tensor of weight set ``b`` (the last layer's down projection ``weight_scale``, so a
loader that copies tensor by tensor gets almost to the end first: :func:`conformance.server.derive.corrupt_target`)
or its file, and is verified before use (:func:`verify`): the damaged checkpoint is ``b`` with exactly that
damage, and the reference loader refuses it naming the tensor (or the file). An engine must refuse the reload
with a message and keep serving ``a`` bit for bit.

==========================  ==========================================  =========================================
class                       NVFP4 checkpoint (``weight_scale``, E4M3)   BF16 copy (``--server-weights bf16``: the
                                                                        linear's dequantized ``weight``)
==========================  ==========================================  =========================================
``corrupt_checkpoint``      the tensor missing (the original class;     the weight missing
                            its scenario id is kept)
``nan_block_scale``         one block scale NaN (byte 0x7f)             the block of 16 weights it scales NaN
``negative_block_scale``    one block scale negative (sign bit set)     none: a negated block is valid BF16 weights
``truncated_file``          the shard holding it cut to half its size   the copy's file cut to half its size
``wrong_shape``             its last row dropped                        its last row dropped
``wrong_dtype``             stored as float32 instead of E4M3           stored as int8 (codes) instead of BF16
==========================  ==========================================  =========================================
"""
from __future__ import annotations

import fcntl
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from conformance.server.derive import INDEX_FILE, _copy_other_files, _load, _save, corrupt_target, tensor_names

NAN_E4M3 = 0x7F
SIGN_BIT = 0x80


def _nan_scale(t: torch.Tensor) -> torch.Tensor:
    out = t.clone().view(torch.uint8)
    out.view(-1)[out.numel() // 2] = NAN_E4M3
    return out.view(torch.float8_e4m3fn)


def _negative_scale(t: torch.Tensor) -> torch.Tensor:
    out = t.clone().view(torch.uint8).view(-1)
    nonzero = (out & 0x7F).nonzero()
    out[int(nonzero[len(nonzero) // 2])] |= SIGN_BIT  # a nonzero scale: -0 would still be a valid zero
    return out.view(torch.float8_e4m3fn).view(t.shape)


def _nan_block(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    row, col = out.shape[0] // 2, (out.shape[1] // 2) // 16 * 16
    out[row, col:col + 16] = float("nan")
    return out


@dataclass(frozen=True)
class Corruption:
    id: str
    what: str
    nvfp4: Callable[[torch.Tensor], torch.Tensor | None] | None  # the damaged tensor (None: removed); None: file
    bf16: Callable[[torch.Tensor], torch.Tensor | None] | None
    refused_for: str  # what the reference loader's refusal must say (formatted with tensor=, file=)
    bf16_reason: str = ""  # why the class does not exist for BF16 copies (bf16 is None and not a file class)
    file_level: bool = False

    def exists_for(self, weights: str) -> str | None:
        """Why this class cannot be offered for ``--server-weights weights`` (None: it can)."""
        if weights == "bf16" and self.bf16 is None and not self.file_level:
            return self.bf16_reason
        return None


CORRUPTIONS = (
    Corruption("corrupt_checkpoint", "one tensor missing", lambda t: None, lambda t: None,
               "missing tensor {tensor!r}"),
    Corruption("nan_block_scale", "one E4M3 block scale NaN", _nan_scale, _nan_block,
               "tensor {tensor!r} holds 1 block scale(s) that are NaN or negative"),
    Corruption("negative_block_scale", "one E4M3 block scale negative", _negative_scale, None,
               "tensor {tensor!r} holds 1 block scale(s) that are NaN or negative",
               bf16_reason="a negated block of BF16 weights is valid weights: no such damage exists for a BF16 copy"),
    Corruption("truncated_file", "the safetensors file holding the tensor cut to half its size", None, None,
               "{file}: cannot read safetensors file", file_level=True),
    Corruption("wrong_shape", "one tensor's last row dropped", lambda t: t[:-1].clone(), lambda t: t[:-1].clone(),
               "tensor {tensor!r} has shape"),
    Corruption("wrong_dtype", "one tensor stored in another dtype (E4M3 scales as float32; BF16 weights as int8)",
               lambda t: t.float(), lambda t: t.to(torch.int8), "tensor {tensor!r} has dtype"),
)
CORRUPTIONS_BY_ID = {c.id: c for c in CORRUPTIONS}


def _shard_of(root: Path, tensor: str) -> Path:
    from safetensors import safe_open

    for shard in sorted(root.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            if tensor in f.keys():
                return shard
    raise ValueError(f"{root}: no shard holds {tensor!r}")


def derive(corruption: Corruption, b: Path, dst: Path, tensor: str, bf16: bool) -> None:
    """Write ``b`` with ``corruption`` applied to ``tensor`` (or to its shard) into ``dst`` (must not exist)."""
    dst.mkdir(parents=True, exist_ok=False)
    target = _shard_of(b, tensor)
    for shard in sorted(b.glob("*.safetensors")):
        if shard != target:
            shutil.copyfile(shard, dst / shard.name)
        elif corruption.file_level:
            data = shard.read_bytes()
            (dst / shard.name).write_bytes(data[: len(data) // 2])
        else:
            tensors, metadata = _load(shard)
            damaged = (corruption.bf16 if bf16 else corruption.nvfp4)(tensors[tensor])
            if damaged is None:
                del tensors[tensor]
            else:
                tensors[tensor] = damaged
            _save(tensors, dst / shard.name, metadata)
    _copy_other_files(b, dst)
    index = dst / INDEX_FILE
    if index.is_file() and not corruption.file_level and corruption.id == "corrupt_checkpoint":
        data = json.loads(index.read_text())
        data.get("weight_map", {}).pop(tensor, None)
        index.write_text(json.dumps(data, indent=2) + "\n")


def corrupt_checkpoint(corruption: Corruption, b: str, work: Path, tensor: str | None = None,
                       bf16: bool = False) -> tuple[str, str]:
    """(path, damaged tensor) of ``corruption`` of weight set ``b``, derived once into ``work`` (locked: xdist
    workers share it)."""
    tensor = tensor or corrupt_target(sorted(tensor_names(b)))
    base = work / corruption.id
    work.mkdir(parents=True, exist_ok=True)
    with open(work / f"{corruption.id}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = base / "corruption.json"
        if not stamp.is_file():
            shutil.rmtree(base, ignore_errors=True)
            derive(corruption, Path(b), base / "ckpt", tensor, bf16)
            stamp.write_text(json.dumps({"corruption": corruption.id, "tensor": tensor, "from": b}) + "\n")
    return str(base / "ckpt"), tensor


def verify(corruption: Corruption, b: str, damaged: str, tensor: str, bf16: bool = False) -> None:
    """Raise AssertionError unless ``damaged`` is ``b`` with exactly ``corruption`` (every other tensor byte for
    byte the same) and, for NVFP4 checkpoints, the reference loader refuses it for that reason. BF16 copies are
    not NVFP4 checkpoints the reference loads: their damage is checked tensor by tensor only."""
    from reference_impl.model.checkpoint import CheckpointError, load_checkpoint, read_tensors
    from reference_impl.model import validate_checkpoint

    shard = _shard_of(Path(b), tensor)
    expected = corruption.refused_for.format(tensor=tensor, file=Path(damaged) / shard.name)
    if corruption.file_level:
        size, full = (Path(damaged) / shard.name).stat().st_size, shard.stat().st_size
        if size != full // 2:
            raise AssertionError(f"{corruption.id}: {Path(damaged) / shard.name} is {size} bytes, not half of {full}")
    else:
        before, after = read_tensors(b), read_tensors(damaged)
        others = sorted(n for n in set(before) | set(after) if n != tensor and (
            n not in before or n not in after or not torch.equal(before[n].contiguous().view(-1).view(torch.uint8),
                                                                  after[n].contiguous().view(-1).view(torch.uint8))))
        if others:
            raise AssertionError(f"{corruption.id}: {damaged} differs from {b} in other tensors than {tensor!r}: "
                                 f"{others[:5]}")
        want = (corruption.bf16 if bf16 else corruption.nvfp4)(before[tensor])
        got = after.get(tensor)
        same = (want is None and got is None) or (
            want is not None and got is not None and want.dtype == got.dtype and want.shape == got.shape
            and torch.equal(want.contiguous().view(-1).view(torch.uint8), got.contiguous().view(-1).view(torch.uint8)))
        if not same:
            raise AssertionError(f"{corruption.id}: {damaged}'s {tensor!r} is not {corruption.what}")
    if bf16:
        return
    try:
        validate_checkpoint(load_checkpoint(damaged))
    except CheckpointError as exc:
        if expected not in str(exc):
            raise AssertionError(f"{corruption.id}: the reference loader refuses {damaged} for another reason than "
                                 f"{expected!r}: {exc}") from exc
        return
    raise AssertionError(f"{corruption.id}: the reference loader accepts {damaged}: it is not broken")
