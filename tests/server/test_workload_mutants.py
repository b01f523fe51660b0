"""The workload scenario can fail where the fixed scenarios cannot: servers right at the scenarios' sizes and
wrong above them (tests/server/mutants.py: a large-M tile dropping a K block in the prefill or in the decode, a
batch bucket serving stale weights after a reload, an MoE expert workspace of 32 tokens) are failed with the bucket named, while a correct
server whose reduction order changes by bucket passes. A small workload (:data:`MINI`) reaches each class on
the fixtures; the fixed scenarios' own verdict on the same mutants is checked too (they pass them)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conformance.server.dialects import make_dialect
from conformance.server.launcher import ServerProcess
from conformance.server.models import ModelCatalog
from conformance.server.scenarios import SCENARIOS_BY_ID, run_scenario, workload_scenario
from conformance.server.workloads import Workload, load

pytestmark = pytest.mark.integration

MUTANT_SCRIPT = Path(__file__).resolve().parent / "mutants.py"
TEMPLATE = ("{python} %s --mutant {mutant} --model-path {model_path} --tokenizer-path {tokenizer_path} --port {port} "
            "--tp 1 --device cpu" % MUTANT_SCRIPT)

#: one prefill above the mutants' 128-token threshold, one decode batch at 17, a reload served at 17
MINI = Workload(name="mini", prefill_lengths=(5, 129), decode_batches=(2, 17), short_length=4, continuation=4,
                repeat=(2, 2), mixed=(33, 2), reload_batches=(17,), probes=32)

CASES = [
    # (mutant, family, caught, what the failure must name, the truth's probe precision)
    ("large_prefill_drops_k_block", "dense-nvfp4_awq", True, r"prefill M 129-256", "fp64"),
    ("large_decode_batch_drops_k_block", "dense-nvfp4_awq", True, r"decode M 17-32, batch of 17", "fp64"),
    ("large_batch_stale_after_reload", "dense-nvfp4_awq", True, r"decode M 17-32, after a reload of b", "fp64"),
    ("moe_expert_workspace_32", "moe-w4a16_nvfp4", True, r"prefill M 129-256", "fp64"),
    ("bucketed_reduction_order", "dense-nvfp4_awq", False, "", "fp64"),
    # --truth-precision fp32 (variance estimates from an fp32 pass): the same verdicts
    ("large_decode_batch_drops_k_block", "dense-nvfp4_awq", True, r"decode M 17-32, batch of 17", "fp32"),
    ("bucketed_reduction_order", "dense-nvfp4_awq", False, "", "fp32"),
]


@pytest.fixture(scope="module")
def catalog():
    return ModelCatalog([], None, [], None)


@pytest.mark.parametrize("mutant,family,caught,match,precision", CASES, ids=[f"{c[0]}-{c[4]}" for c in CASES])
def test_workload_judges_every_bucket(catalog, mutant, family, caught, match, precision, tmp_path):
    model = catalog.served(family)
    truths = {s: catalog.truth(model, s) for s in ("a", "b")}
    server = ServerProcess(TEMPLATE, 240.0, mutant=mutant, model_path=model.a, tokenizer_path=model.tokenizer, tp=1)
    try:
        client = make_dialect("sglang", server.url)
        scenario = workload_scenario(MINI, "cpu", tmp_path, precision)
        if caught:
            with pytest.raises(AssertionError, match=match):
                run_scenario(scenario, client, model, truths, timeout_s=900)
            # the fixed scenarios never reach these sizes: they pass the same server
            if mutant == "large_batch_stale_after_reload":
                run_scenario(SCENARIOS_BY_ID["reload_different_weights"], client, model, truths, timeout_s=300)
        else:
            result = run_scenario(scenario, client, model, truths, timeout_s=900)
            assert result.compared > 0
        coverage = next(tmp_path.glob("coverage-*.json"))  # written pass or fail
        assert '"status": "not reached"' not in coverage.read_text()
        assert coverage.with_suffix(".md").is_file() and coverage.with_suffix(".png").stat().st_size > 0
    finally:
        server.stop()


def test_fp32_truth_refuses_a_routing_model(catalog, tmp_path):
    """--truth-precision fp32 on an MoE checkpoint: a clear failure before any request (an fp32 pass may route a
    near-tie otherwise than the fp64 values it would estimate for)."""
    model = catalog.served("moe-w4a16_nvfp4")
    truths = {s: catalog.truth(model, s) for s in ("a", "b")}
    server = ServerProcess(TEMPLATE, 240.0, mutant="bucketed_reduction_order", model_path=model.a,
                           tokenizer_path=model.tokenizer, tp=1)
    try:
        client = make_dialect("sglang", server.url)
        with pytest.raises(pytest.fail.Exception, match="--truth-precision fp32 is for dense checkpoints"):
            run_scenario(workload_scenario(MINI, "cpu", tmp_path, "fp32"), client, model, truths, timeout_s=300)
    finally:
        server.stop()


def test_workload_files_are_checked(tmp_path):
    """A workload file: fields checked by name, a bad one a clear error; the built-ins as documented."""
    good = tmp_path / "mine.toml"
    good.write_text("prefill_lengths = [1, 300]\ndecode_batches = [1, 64]\nshort_length = 8\ncontinuation = 64\n"
                    "repeat = [8, 2]\nmixed = [300, 4]\nreload_batches = [64]\n")
    w = load(str(good))
    assert w.name == "mine" and w.pool_size == 64 and w.prefill_lengths == (1, 300)
    with pytest.raises(ValueError, match="exceeds the model's 256 positions"):
        w.check(max_positions=256)
    bad = tmp_path / "bad.toml"
    bad.write_text("prefill_lengths = [0]\n")
    with pytest.raises(ValueError, match="missing fields"):
        load(str(bad))
    bad.write_text(good.read_text() + "decode_batchs = [3]\n")
    with pytest.raises(ValueError, match="unknown fields \\['decode_batchs'\\]"):
        load(str(bad))
    bad.write_text(good.read_text().replace("[1, 64]", "[0, 64]"))
    with pytest.raises(ValueError, match="decode_batches must hold integers >= 1"):
        load(str(bad))
    for screen in (7, 64, -2):  # odd, not fewer than the probes, negative
        bad.write_text(good.read_text() + f"screen_probes = {screen}\n")
        with pytest.raises(ValueError, match="screen_probes must be 0 \\(no screen\\) or an even number"):
            load(str(bad))
    bad.write_text(good.read_text() + "screen_probes = 0\n")
    assert load(str(bad)).screen_probes == 0 and w.screen_probes == 8
    with pytest.raises(ValueError, match="not a built-in"):
        load("no-such-workload")
    std = load("standard")
    assert max(std.prefill_lengths) >= 8193 and max(std.decode_batches) >= 257 and std.continuation >= 64
    assert load("quick").check(max_positions=256) is None


def test_coverage_map_and_failure_message(tmp_path):
    """The coverage map's cells (passed / failed / not reached / not planned) and a failure naming its bucket,
    phase, request and position, from a hand-made coverage."""
    from conformance.server.workload_coverage import Coverage, Planned, Row, failure_message

    cov = Coverage("t")
    for plan in (Planned("prefill of 9 tokens", "a", 9, 1), Planned("batch of 40", "a", 160, 40)):
        cov.expect(plan)
    cov.cell("prefill", "9-16").judged = 8
    cov.cell("decode", "1").judged = 4
    cov.cell("decode", "1").failed = 1
    cov.failures.append(Row("prefill of 9 tokens", "decode", "1", 9, "logprob", -1.5, -1.0, 0.1))
    cells = {(e["phase"], e["bucket"]): e["status"] for e in cov.as_dict()["cells"]}
    assert cells[("prefill", "9-16")] == "passed" and cells[("decode", "1")] == "failed"
    assert cells[("prefill", "129-256")] == "not reached" and cells[("decode", "33-64")] == "not reached"
    assert cells[("prefill", "2")] == "not planned"
    assert cov.not_reached() == [("decode", "33-64"), ("prefill", "129-256")]
    msg = failure_message(cov, "workload_t")
    assert "1 of 12 positions" in msg and "decode M 1: 1" in msg
    assert "decode M 1, prefill of 9 tokens, position 9: logprob" in msg and "5.0x" in msg
    written = cov.write(tmp_path, "coverage-t")
    assert [p.suffix for p in written][:2] == [".json", ".md"]


def test_fp32_truth_keeps_each_weight_sets_layers_within_its_budget(catalog):
    """--truth-precision fp32 keeps each weight set's cast layers between the scenario's passes (a bounded share of
    the truth device's memory, released after); fp64 keeps none."""
    from conformance.server.workload_scenario import _kept_layers, exact_model

    model = catalog.served("dense-nvfp4_awq")
    exact = {s: exact_model(getattr(model.truth_model, s), "cpu") for s in ("a", "b")}
    with _kept_layers(exact, "fp64"):
        assert all(getattr(m.truth, "_probe_layers", None) is None for m in exact.values())
    with _kept_layers(exact, "fp32"):
        kept = [m.truth._probe_layers for m in exact.values()]
        assert all(k is not None and k.dtype == torch.float32 and k.budget == 1 << 30 for k in kept)
    assert all(m.truth._probe_layers is None for m in exact.values())
