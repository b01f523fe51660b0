"""A server that cannot serve says so at once: the reference server with a broken HTTP stack (a module that
raises at import, first on its path) exits with a non-zero code, and the launcher reports it within
seconds, quoting the traceback from the log, on every device and parallel configuration.

Two places the HTTP stack can break: ``fastapi`` (imported before any rank, device or weight exists) and
``h11``, uvicorn's HTTP protocol (imported only when serving starts, after the ranks are up and the weights
loaded: what used to keep a CUDA server alive until the start timeout). On an H200:

    python -m pytest tests/server/test_server_startup.py -m "cuda or multi_gpu" -v
"""
from __future__ import annotations

import time

import pytest

from conformance.server.launcher import REFERENCE_TEMPLATE, ServerProcess, ServerStartError
from conformance.server.models import ModelCatalog

pytestmark = pytest.mark.integration  # starts servers or whole pytest runs (ci/time_tests.py times them apart)

LIMIT_S = 15.0
CONFIGS = [pytest.param("cpu", 1, marks=pytest.mark.cpu, id="cpu-tp1"),
           pytest.param("cpu", 2, marks=pytest.mark.cpu, id="cpu-tp2"),
           pytest.param("cuda", 1, marks=pytest.mark.cuda, id="cuda-tp1"),
           pytest.param("cuda", 2, marks=pytest.mark.multi_gpu, id="cuda-tp2")]


@pytest.mark.parametrize("module", ["fastapi", "h11"])
@pytest.mark.parametrize("device,tp", CONFIGS)
def test_broken_http_stack_fails_fast(tmp_path, device, tp, module, record_property):
    model = ModelCatalog([], None, [], None).served("dense-nvfp4_awq")
    (tmp_path / f"{module}.py").write_text(
        f"raise ImportError('deliberately broken {module} (start-up failure test)')\n")
    start = time.monotonic()
    with pytest.raises(ServerStartError) as failure:
        ServerProcess(REFERENCE_TEMPLATE, 120.0, env={"PYTHONPATH": str(tmp_path)}, model_path=model.a,
                      tokenizer_path=model.tokenizer, tp=tp, dp=1, ep=1, device=device)
    elapsed = time.monotonic() - start
    record_property("seconds_to_report", round(elapsed, 2))
    message = str(failure.value)
    assert elapsed < LIMIT_S, f"the launcher took {elapsed:.1f} s to report the failure:\n{message}"
    assert "during start-up" in message and "exited with code 0 " not in message, message
    assert "Traceback" in message and f"ImportError: deliberately broken {module}" in message, message


@pytest.mark.cpu
@pytest.mark.parametrize("corruption", ["nan_block_scale", "negative_block_scale", "truncated_file"])
def test_damaged_checkpoint_at_start_up_exits_naming_it(tmp_path, corruption):
    """A server started on a checkpoint with a damaged block scale or a cut file exits at once, saying which
    tensor (or file) is damaged: it never serves garbage (issue 37)."""
    from conformance.server.corruptions import CORRUPTIONS_BY_ID, corrupt_checkpoint

    model = ModelCatalog([], None, [], None).served("dense-nvfp4_awq")
    path, tensor = corrupt_checkpoint(CORRUPTIONS_BY_ID[corruption], model.a, tmp_path / "work", model.corrupt_tensor)
    start = time.monotonic()
    with pytest.raises(ServerStartError) as failure:
        ServerProcess(REFERENCE_TEMPLATE, 120.0, model_path=path, tokenizer_path=model.tokenizer, tp=1, dp=1, ep=1,
                      device="cpu")
    message = str(failure.value)
    assert time.monotonic() - start < LIMIT_S, message
    assert "during start-up" in message, message
    if corruption == "truncated_file":
        assert "cannot read safetensors file" in message, message
    else:
        assert f"tensor {tensor!r} holds 1 block scale(s) that are NaN or negative" in message, message
