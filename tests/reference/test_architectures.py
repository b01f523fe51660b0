"""Every architecture the reference supports (reference_impl/model/architectures.py), on a tiny random model of each
written by an independent path -- NVIDIA ModelOpt 0.47 on CPU (tests/reference/modelopt_exporter.py), which exports all
five: Llama, Qwen3 dense (q/k norms), Qwen3-MoE, Mixtral (ModelOpt writes the original
``block_sparse_moe.experts.<e>.w1/w3/w2`` naming) and DeepSeek-V3 (MLA with q_lora, YaRN, interleaved rotary,
a dense first layer, then 16 routed experts in 4 groups top-2 groups top-4 experts, a shared expert, sigmoid
scores with a nonzero ``e_score_correction_bias``, ``routed_scaling_factor`` 2.5):

* the golden truth (:class:`reference_impl.truth.engine.TruthModel`: transformers' decoder layers streamed one at
  a time, weights dequantized per layer, hooks attached) agrees in fp64 with transformers' *whole* model class
  loaded the ordinary way (``load_state_dict`` of the exactly dequantized weights, tests/reference/test_checkpoints.py),
  within the derived bound of tests/reference/test_checkpoints.py (fp32 stages x GAIN x 2^-24 x max|logit|);
* the reference server's hand-written model (exact mode) agrees with the same transformers model, same bound;
* the comparison has the power to catch a misread architecture feature: each mutation of the transformers side
  below (a dropped score correction, routed scaling 1, q/k norms off, gate/up swapped, ...) moves the logits far
  beyond the bound;
* the scenario suite (all 7 TP1 scenarios) passes on each export through ``--server-checkpoint`` served by
  the reference server (Llama's runs are tests/reference/test_modelopt_checkpoint.py's and tests/reference/test_byo_checkpoint.py's);
* Nemotron-H (hybrid Mamba-2) is refused at start with the reason.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

# find_spec, not importorskip: importing ModelOpt takes ~8 s (it imports its vLLM and transformers plugins),
# which every xdist worker would pay at collection; the tests import it when they export
pytestmark = pytest.mark.skipif(importlib.util.find_spec("modelopt") is None,
                                reason="needs nvidia-modelopt (installed by ci/install-test-deps.sh)")
pytest.importorskip("transformers", reason="needs transformers (the [test] extra, ci/install-test-deps.sh)")

from tests.reference import byo_exporter, modelopt_exporter  # noqa: E402
from tests.reference.test_checkpoints import GAIN, PROMPT, fp32_stages, transformers_model  # noqa: E402

ARCHS = modelopt_exporter.ARCHS
ALGO = "W4A16_NVFP4"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``tiny(arch)``: the tiny ModelOpt export of ``arch`` (made on first use in this module)."""
    base, made = tmp_path_factory.mktemp("arch"), {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = modelopt_exporter.export(base / arch, arch, ALGO, size="tiny")
        return made[arch]
    return get


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return byo_exporter.write_tokenizer(tmp_path_factory.mktemp("tok"), modelopt_exporter.VOCAB).parent


def _bound(cfg, logits: torch.Tensor) -> float:
    return fp32_stages(cfg) * GAIN * 2.0 ** -24 * float(logits.abs().max())


def _theirs(path: Path, mutate=None) -> torch.Tensor:
    from reference_impl.model.checkpoint import load_checkpoint

    model = transformers_model(load_checkpoint(path))
    if mutate is not None:
        mutate(model)
    with torch.no_grad():
        return model(PROMPT[None]).logits[0]


def _truth(path: Path) -> tuple[object, torch.Tensor]:
    from reference_impl.truth.engine import TruthModel

    truth = TruthModel(str(path), device="cpu")
    passes, _ = truth.forward([PROMPT.tolist()])
    return truth.cfg, passes[0].logits


def test_what_the_exports_hold(tiny):
    """The architecture features these tests are meant to exercise are in the files (if ModelOpt or transformers
    stop writing them, this says so instead of the tests below silently testing less)."""
    from reference_impl.model.checkpoint import load_checkpoint
    from reference_impl.model import validate_checkpoint

    ds = load_checkpoint(tiny("deepseek_v3"))
    cfg = validate_checkpoint(ds)
    assert cfg.is_mla and cfg.q_lora_rank and cfg.rope_interleave and cfg.n_shared_experts == 1
    assert cfg.moe_layers == (1,) and (cfg.n_group, cfg.topk_group, cfg.top_k) == (4, 2, 4)
    assert cfg.routed_scaling_factor == 2.5 and ds.hf_config["rope_parameters"]["rope_type"] == "yarn"
    assert float(ds.tensors["model.layers.1.mlp.gate.e_score_correction_bias"].abs().max()) > 0.01
    mixtral = validate_checkpoint(load_checkpoint(tiny("mixtral")))
    assert mixtral.moe_prefix == "block_sparse_moe" and mixtral.expert_names == ("w1", "w3", "w2")
    assert validate_checkpoint(load_checkpoint(tiny("qwen3"))).qk_norm


@pytest.mark.parametrize("arch", ARCHS)
def test_truth_matches_transformers(tiny, arch):
    """The truth's layer-streamed, hooked forward vs transformers' whole model class on the same exactly
    dequantized weights: both are fp64 with the same fp32 stages, so they differ by no more than the derived
    bound (measured on these exports: 0.0, bitwise equal, against bounds 6e-6..1e-5; the mutations below move
    logits by 0.58..2.2)."""
    cfg, ours = _truth(tiny(arch))
    theirs = _theirs(tiny(arch))
    err, bound = float((ours - theirs).abs().max()), _bound(cfg, theirs)
    assert err <= bound, f"{arch}: truth vs transformers max |logit difference| {err:.3e} > derived bound {bound:.3e}"


@pytest.mark.parametrize("arch", ARCHS)
def test_serving_model_matches_transformers(tiny, arch):
    """The reference server's hand-written model, exact mode, vs transformers (tests/reference/test_checkpoints.py)."""
    from reference_impl.model.checkpoint import load_checkpoint
    from tests.reference.test_checkpoints import assert_matches_transformers

    assert_matches_transformers(load_checkpoint(tiny(arch)), arch)


def _swap_gate_up(model, layer: int = 0) -> None:
    mlp = model.model.layers[layer].mlp
    mlp.gate_proj.weight.data, mlp.up_proj.weight.data = mlp.up_proj.weight.data.clone(), mlp.gate_proj.weight.data.clone()


def _qk_norm_off(model) -> None:
    for layer in model.model.layers:
        layer.self_attn.q_norm = layer.self_attn.k_norm = torch.nn.Identity()


def _norm_weights_ignored(model) -> None:
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)


def _expert_gate_up_swapped(model, layer: int = 1) -> None:
    w = model.model.layers[layer].mlp.experts.gate_up_proj.data
    half = w.shape[1] // 2
    model.model.layers[layer].mlp.experts.gate_up_proj.data = torch.cat([w[:, half:], w[:, :half]], dim=1)


def _no_score_correction(model) -> None:
    model.model.layers[1].mlp.gate.e_score_correction_bias.data.zero_()


def _scaling_one(model) -> None:
    model.model.layers[1].mlp.gate.routed_scaling_factor = 1.0


def _rope_not_interleaved(model) -> None:
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    for layer in model.model.layers:
        layer.self_attn.config.rope_interleave = False
    assert hasattr(m, "apply_rotary_pos_emb")


MUTATIONS = {  # id: (arch, what a reader could get wrong, the change on the transformers side)
    "llama-gate-up-swapped": ("llama", _swap_gate_up),
    "qwen3-qk-norm-ignored": ("qwen3", _qk_norm_off),
    "qwen3-norm-weights-ignored": ("qwen3", _norm_weights_ignored),
    "qwen3_moe-expert-gate-up-swapped": ("qwen3_moe", _expert_gate_up_swapped),
    "mixtral-w1-w3-swapped": ("mixtral", _expert_gate_up_swapped),
    "deepseek-score-correction-dropped": ("deepseek_v3", _no_score_correction),
    "deepseek-routed-scaling-ignored": ("deepseek_v3", _scaling_one),
    "deepseek-rope-not-interleaved": ("deepseek_v3", _rope_not_interleaved),
}


@pytest.mark.parametrize("case", MUTATIONS)
def test_the_comparison_catches_a_misread_feature(tiny, case):
    """The truth against a transformers model with one architecture feature misread exceeds the bound by far
    (at least 100x): the agreement above is evidence, not a bound too loose to fail."""
    arch, mutate = MUTATIONS[case]
    cfg, ours = _truth(tiny(arch))
    theirs = _theirs(tiny(arch), mutate)
    err, bound = float((ours - theirs).abs().max()), _bound(cfg, theirs)
    assert err > 100 * bound, f"{case}: the mutation moved logits by only {err:.3e} (bound {bound:.3e})"


# ----------------------------------------------------------------------------------------- the scenario suite
@pytest.mark.integration
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "llama"])
def test_scenarios_on_every_architecture(tiny, tokenizer, tmp_path, arch):
    """Every TP1 scenario passes (none skipped) on the tiny export served by the reference server, the truth
    computed by TruthModel; the directory is left exactly as it was."""
    from tests.reference.test_byo_checkpoint import assert_suite_passes_and_leaves_checkpoint_untouched

    assert_suite_passes_and_leaves_checkpoint_untouched(tmp_path, tiny(arch), ["--tokenizer", str(tokenizer)])


# ----------------------------------------------------------------------------------------- refused
NEMOTRON_H = r"architecture NemotronHForCausalLM is not supported: hybrid Mamba-2 / attention layers"


def _as_nemotron_h(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(architectures=["NemotronHForCausalLM"], model_type="nemotron_h", hybrid_override_pattern="M*M-")
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_nemotron_h_is_refused_with_the_reason(tiny, tokenizer, tmp_path):
    """A Nemotron-H checkpoint: the suite stops at start with the reason (the reference has no Mamba-2 path and
    its rounding model does not describe the selective scan), and so do the truth and the server's model."""
    from conformance.server.models import ModelCatalog, ModelError
    from reference_impl.model.checkpoint import CheckpointError
    from reference_impl.truth.engine import TruthModel

    path = _as_nemotron_h(tiny("llama"), tmp_path / "nemotron-h")
    with pytest.raises(ModelError, match=f"cannot be served by the reference: .*{NEMOTRON_H}"):
        ModelCatalog([], None, [str(path)], str(tokenizer)).check_user_checkpoints()
    with pytest.raises(CheckpointError, match=f"{NEMOTRON_H}.*selective state-space scan"):
        TruthModel(str(path), device="cpu")
