"""Fixture checkpoints and the reference model, checked against an independent implementation.

The independent implementation is ``transformers`` (the checkpoint's own model class) in float64 with
the checkpoint's weights dequantized in float64 (``e2m1 * e4m3 * weight_scale_2``, with the AWQ
``pre_quant_scale`` folded into the weight columns: ``(x * s) @ W^T == x @ (W * s)^T``). Our reference model
runs in its exact (float64) mode, which keeps the same fp32 stages as transformers (RMSNorm statistics,
rotary tables, attention and router softmax).

Derived bound: the two computations differ only by float64 rounding (relative 2^-53, invisible at this
scale) and by the fp32 roundings those differences can flip in the fp32 stages. A flip changes one value by
at most one fp32 ulp, relative 2^-24. Along any path to a logit there are ``S`` such stages (per layer: two
RMSNorms, rotary tables, attention softmax, q/k norms and router softmax where present; plus the final
norm); to first order the relative perturbations of the stages add, and each passes through at most
``GAIN`` = 4 (the largest amplification of a relative perturbation by one residual block of these
fixtures, whose weights are drawn at 1/sqrt(fan_in) scale so blocks roughly preserve norms). Hence
``|dlogit| <= S * GAIN * 2^-24 * max|logit|``. A layout error (nibble order, scale row, gate/up swap,
missing AWQ scale) changes logits by O(0.1) or more, far above this bound (about 1e-5 here).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass

import pytest
import torch

from fixtures.make_checkpoints import ALGOS, ARCHS, checkpoint_name, corrupt_tensor_name, ensure_checkpoints
from reference_impl.model.checkpoint import CheckpointError, load_checkpoint, read_configs
from reference_impl.dense import w4a16_linear
from reference_impl.model import Layout, TinyModel, shard_weights, validate_checkpoint
from reference_impl.format.nvfp4 import BLOCK_SIZE, e2m1_decode, e4m3_decode, unpack_nibbles

GAIN = 4.0
PROMPT = torch.tensor([1, 4, 53, 5, 103, 6, 119, 20, 30, 40, 50, 60, 70, 80])


@pytest.fixture(scope="session")
def ckpt_root():
    return ensure_checkpoints()


def dequant64(t: dict, prefix: str) -> torch.Tensor:
    d = e2m1_decode(unpack_nibbles(t[f"{prefix}.weight"]), torch.float64)
    d = d * e4m3_decode(t[f"{prefix}.weight_scale"]).double().repeat_interleave(BLOCK_SIZE, -1)
    d = d * t[f"{prefix}.weight_scale_2"].double()
    if f"{prefix}.pre_quant_scale" in t:
        d = d * t[f"{prefix}.pre_quant_scale"].double()[None, :]
    return d


def transformers_model(ckpt):
    """The transformers model class loaded with the float64-dequantized weights."""
    import transformers

    from reference_impl.model.architectures import ModelConfig

    cfg_dict = {k: v for k, v in ckpt.hf_config.items() if k != "quantization_config"}
    hf_cfg = transformers.AutoConfig.for_model(**cfg_dict)
    hf_cfg._experts_implementation = "eager"  # the grouped-mm kernel has no float64 version
    hf_cfg._attn_implementation = "eager"
    ours = ModelConfig.from_hf(ckpt.hf_config, set(ckpt.tensors))
    model = getattr(transformers, ckpt.hf_config["architectures"][0])(hf_cfg).double().eval()
    t, sd = ckpt.tensors, {}
    for k, v in t.items():
        if k.endswith(".weight") and v.dtype == torch.uint8:
            sd[k] = dequant64(t, k[: -len(".weight")])
        elif k.endswith((".weight", ".e_score_correction_bias")):
            sd[k] = v.double()
    for i in ours.moe_layers:  # transformers 5 stores experts as fused 3-D parameters; Mixtral's old naming renamed
        names = [[sd.pop(f"{ours.expert(i, e, w)}.weight") for w in range(3)] for e in range(ours.num_experts)]
        p = f"model.layers.{i}.mlp"
        sd[f"{p}.experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u, _ in names])
        sd[f"{p}.experts.down_proj"] = torch.stack([d for _, _, d in names])
        for k in [k for k in sd if k.startswith(f"model.layers.{i}.{ours.moe_prefix}.gate.")]:
            sd[f"{p}.gate.{k.rsplit('.', 1)[1]}"] = sd.pop(k)
    if ours.router == "sigmoid_grouped":  # transformers keeps DeepSeek's router in fp32
        for k in [k for k in sd if ".mlp.gate." in k]:
            sd[k] = sd[k].float()
        for i in ours.moe_layers:
            model.model.layers[i].mlp.gate.float()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if hf_cfg.tie_word_embeddings:  # no lm_head.weight in the file: transformers' own tying supplies it
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "lm_head not tied"
        missing = [m for m in missing if m != "lm_head.weight"]
    unexpected = [u for u in unexpected if not u.startswith(f"model.layers.{ours.num_layers}.")]  # DeepSeek's MTP layer
    assert not missing and not unexpected, f"state dict mismatch: missing {missing}, unexpected {unexpected}"
    return model


def fp32_stages(cfg) -> int:
    """fp32 stages along a path to a logit: per layer 2 RMSNorms, the rotary tables and the attention softmax,
    plus the q/k norms (Qwen3), the latent RMSNorms (DeepSeek-V3's q_a / kv_a), and in a MoE layer the router
    softmax (Qwen3-MoE, Mixtral) or DeepSeek-V3's fp32 router GEMM and sigmoid; plus the final norm."""
    stages = 0
    for i in range(cfg.num_layers):
        stages += 4 + (2 if cfg.qk_norm else 0) + ((1 + bool(cfg.q_lora_rank)) if cfg.is_mla else 0)
        if cfg.is_moe(i):
            stages += 2 if cfg.router == "sigmoid_grouped" else 1
    return stages + 1


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("algo", ALGOS)
def test_reference_model_matches_transformers(ckpt_root, arch, algo):
    assert_matches_transformers(load_checkpoint(ckpt_root / checkpoint_name(arch, algo, "a")), f"{arch}/{algo}")


def assert_matches_transformers(ckpt, label: str) -> None:
    """Our model's exact mode vs transformers' own model class on the checkpoint's float64-dequantized weights,
    within the bound derived in this module's docstring."""
    cfg = validate_checkpoint(ckpt)
    ours = TinyModel(cfg, shard_weights(cfg, ckpt.tensors), act_dtype=torch.float64).logits([PROMPT])
    with torch.no_grad():
        theirs = transformers_model(ckpt)(PROMPT[None]).logits[0]
    bound = fp32_stages(cfg) * GAIN * 2.0 ** -24 * float(theirs.abs().max())
    err = float((ours - theirs).abs().max())
    assert err <= bound, f"{label}: max |logit difference| {err:.3e} > derived bound {bound:.3e}"


@pytest.mark.parametrize("arch", ARCHS)
def test_awq_scale_matters(ckpt_root, arch):
    """The AWQ fixture must be sensitive to its pre_quant_scale (else the AWQ checks could not fail)."""
    ckpt = load_checkpoint(ckpt_root / checkpoint_name(arch, "NVFP4_AWQ", "a"))
    cfg = validate_checkpoint(ckpt)
    good = TinyModel(cfg, shard_weights(cfg, ckpt.tensors)).logits([PROMPT])
    dropped = {k: v for k, v in ckpt.tensors.items() if not k.endswith("pre_quant_scale")}
    bad = TinyModel(cfg, shard_weights(cfg, dropped)).logits([PROMPT])
    assert float((good - bad).abs().max()) > 0.1


def test_prepared_linear_is_w4a16_linear(ckpt_root):
    """The model's prepared linear computes exactly reference_impl.dense.w4a16_linear (fp64 accumulation)."""
    ckpt = load_checkpoint(ckpt_root / checkpoint_name("dense", "NVFP4_AWQ", "a"))
    cfg = validate_checkpoint(ckpt)
    model = TinyModel(cfg, shard_weights(cfg, ckpt.tensors))
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    p, w = "model.layers.0.self_attn.q_proj", model.w
    ref = w4a16_linear(x, w[f"{p}.weight"], w[f"{p}.weight_scale"], w[f"{p}.weight_scale_2"],
                       pre_quant_scale=w[f"{p}.pre_quant_scale"], out_dtype=torch.float64, accum_dtype=torch.float64)
    assert torch.equal(model.linear(x, p), ref)


@pytest.mark.parametrize("layout", [Layout(attn_size=2, attn_rank=r, ep_size=2, ep_rank=r) for r in range(2)]
                         + [Layout(attn_size=2, attn_rank=r, moe_tp_size=2, moe_tp_rank=r) for r in range(2)],
                         ids=["ep2-r0", "ep2-r1", "moetp2-r0", "moetp2-r1"])
def test_shards_partition_the_weights(ckpt_root, layout):
    """Sharded linears hold exactly their slice (packed columns and scale columns move together)."""
    ckpt = load_checkpoint(ckpt_root / checkpoint_name("moe", "NVFP4_AWQ", "a"))
    cfg = validate_checkpoint(ckpt)
    shard = shard_weights(cfg, ckpt.tensors, layout)
    full = ckpt.tensors
    r, cols = layout.attn_rank, cfg.num_heads * cfg.head_dim // layout.attn_size  # o_proj input columns per rank
    o = "model.layers.0.self_attn.o_proj"
    assert torch.equal(shard[f"{o}.weight"], full[f"{o}.weight"][:, r * cols // 2:(r + 1) * cols // 2])
    assert torch.equal(shard[f"{o}.weight_scale"].view(torch.uint8),
                       full[f"{o}.weight_scale"][:, r * cols // 16:(r + 1) * cols // 16].view(torch.uint8))
    assert torch.equal(shard[f"{o}.pre_quant_scale"], full[f"{o}.pre_quant_scale"][r * cols:(r + 1) * cols])
    per_rank = cfg.num_experts // layout.ep_size
    experts = {int(k.split(".")[5]) for k in shard if ".experts." in k}
    assert experts == set(range(layout.ep_rank * per_rank, (layout.ep_rank + 1) * per_rank))


def test_kv_heads_are_replicated_beyond_their_count(ckpt_root):
    """TP4 over 2 KV heads: ranks 0,1 hold KV head 0 and ranks 2,3 KV head 1 (as engines replicate)."""
    ckpt = load_checkpoint(ckpt_root / checkpoint_name("dense", "NVFP4", "a"))
    cfg = validate_checkpoint(ckpt)
    assert cfg.num_kv_heads == 2
    k, hd = "model.layers.0.self_attn.k_proj.weight", cfg.head_dim
    for rank in range(4):
        shard = shard_weights(cfg, ckpt.tensors, Layout(attn_rank=rank, attn_size=4))
        head = rank // 2
        assert torch.equal(shard[k], ckpt.tensors[k][head * hd:(head + 1) * hd])


# ----------------------------------------------------------------------------------------- malformed checkpoints
@dataclass(frozen=True)
class Malformed:
    id: str
    edit: str  # what to do to a copy of dense-nvfp4_awq-a
    match: str


MALFORMED = [
    Malformed("missing-tensor", "drop:model.layers.1.mlp.down_proj.weight_scale", r"missing tensor 'model\.layers\.1\.mlp\.down_proj\.weight_scale'"),
    Malformed("wrong-awq-scale-shape", "shape:model.layers.0.self_attn.q_proj.pre_quant_scale", r"'model\.layers\.0\.self_attn\.q_proj\.pre_quant_scale' has shape \(255,\), expected \(256,\)"),
    Malformed("wrong-dtype", "dtype:model.layers.0.self_attn.q_proj.weight_scale", r"'model\.layers\.0\.self_attn\.q_proj\.weight_scale' has dtype torch\.float32, expected torch\.float8_e4m3fn"),
    Malformed("wrong-shape", "shape:model.layers.0.mlp.up_proj.weight", r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape \(511, 128\), expected \(512, 128\)"),
    Malformed("bad-global-scale", "zero:model.layers.0.mlp.up_proj.weight_scale_2", r"'model\.layers\.0\.mlp\.up_proj\.weight_scale_2' must be finite and positive"),
    # E4M3 block scales (issue 37): E4M3FN has no infinity; its non-finite codes are NaN (0x7f, 0xff)
    Malformed("nan-block-scale", "byte:model.layers.1.mlp.down_proj.weight_scale:0x7f", r"'model\.layers\.1\.mlp\.down_proj\.weight_scale' holds 1 block scale\(s\) that are NaN or negative \(first at index \[\d+, \d+\]: byte 0x7f"),
    Malformed("nan-block-scale-ff", "byte:model.layers.0.self_attn.q_proj.weight_scale:0xff", r"'model\.layers\.0\.self_attn\.q_proj\.weight_scale' holds 1 block scale\(s\) that are NaN or negative .*byte 0xff"),
    Malformed("negative-block-scale", "byte:model.layers.0.mlp.gate_proj.weight_scale:0xb8", r"'model\.layers\.0\.mlp\.gate_proj\.weight_scale' holds 1 block scale\(s\) that are NaN or negative .*byte 0xb8 = -1\.0"),
    Malformed("inf-global-scale", "inf:model.layers.0.mlp.up_proj.weight_scale_2", r"'model\.layers\.0\.mlp\.up_proj\.weight_scale_2' must be finite and positive, got \[inf\]"),
    Malformed("bad-algo", "algo:FP4_MAGIC", r"quant_algo 'FP4_MAGIC' is not one of"),
    Malformed("bad-group-size", "group:32", r"group_size 32 is not 16"),
    Malformed("no-quant-config", "noquant", r"no hf_quant_config\.json and no quantization_config"),
    Malformed("bad-json", "badjson", r"config\.json: not valid JSON"),
    Malformed("no-safetensors", "nosafetensors", r"no \*\.safetensors files"),
]


def _apply(path, edit):
    from safetensors.torch import load_file, save_file

    kind, _, arg = edit.partition(":")
    st = path / "model.safetensors"
    if kind in ("drop", "dtype", "shape", "zero", "byte", "inf"):
        t = load_file(str(st))
        if kind == "byte":  # one block scale (the middle one) set to the given E4M3 byte
            arg, _, byte = arg.partition(":")
            codes = t[arg].clone().view(torch.uint8)
            codes.view(-1)[codes.numel() // 2] = int(byte, 16)
            t[arg] = codes.view(torch.float8_e4m3fn)
        elif kind == "inf":
            t[arg] = torch.full_like(t[arg], float("inf"))
        elif kind == "drop":
            del t[arg]
        elif kind == "dtype":
            t[arg] = t[arg].float()
        elif kind == "shape":
            t[arg] = t[arg][:-1].contiguous()
        else:
            t[arg] = torch.zeros_like(t[arg])
        save_file(t, str(st))
    elif kind in ("algo", "group"):
        q = json.loads((path / "hf_quant_config.json").read_text())
        q["quantization"]["quant_algo" if kind == "algo" else "group_size"] = arg if kind == "algo" else int(arg)
        (path / "hf_quant_config.json").write_text(json.dumps(q))
    elif kind == "noquant":
        (path / "hf_quant_config.json").unlink()
        c = json.loads((path / "config.json").read_text())
        del c["quantization_config"]
        (path / "config.json").write_text(json.dumps(c))
    elif kind == "badjson":
        (path / "config.json").write_text("{not json")
    elif kind == "nosafetensors":
        st.unlink()


@pytest.mark.parametrize("case", MALFORMED, ids=[m.id for m in MALFORMED])
def test_malformed_checkpoint_is_rejected_by_name(ckpt_root, tmp_path, case):
    path = tmp_path / "ckpt"
    shutil.copytree(ckpt_root / checkpoint_name("dense", "NVFP4_AWQ", "a"), path)
    _apply(path, case.edit)
    with pytest.raises(CheckpointError, match=case.match):
        validate_checkpoint(load_checkpoint(path))


def test_flat_and_nested_configs_agree(ckpt_root, tmp_path):
    path = tmp_path / "flat"
    shutil.copytree(ckpt_root / checkpoint_name("moe", "W4A16_NVFP4", "a"), path)
    nested = read_configs(path)[1]
    (path / "hf_quant_config.json").unlink()
    flat = read_configs(path)[1]
    assert nested == flat and flat.quant_algo == "W4A16_NVFP4"
    assert flat.is_excluded("model.layers.1.mlp.gate") and not flat.is_excluded("model.layers.1.mlp.gate_proj")


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


@pytest.mark.parametrize("arch", ARCHS)
def test_corrupt_fixture_fails_on_its_missing_tensor(ckpt_root, arch):
    ckpt = load_checkpoint(ckpt_root / checkpoint_name(arch, "NVFP4", "corrupt"))
    with pytest.raises(CheckpointError, match="missing tensor"):
        validate_checkpoint(ckpt)
    assert corrupt_tensor_name(arch, ckpt.hf_config) not in ckpt.tensors


def test_fixtures_are_deterministic(tmp_path, ckpt_root):
    """Two builds give byte-identical safetensors (CI can rebuild instead of committing them)."""
    from fixtures.make_checkpoints import build

    build(tmp_path, archs=("dense",), algos=("NVFP4_AWQ",))
    for name in ("dense-nvfp4_awq-a", "dense-nvfp4_awq-b", "dense-nvfp4_awq-corrupt"):
        assert (tmp_path / name / "model.safetensors").read_bytes() == (ckpt_root / name / "model.safetensors").read_bytes()


# ----------------------------------------------------------------------------------------- what real exports do
def _edited_copy(src, dst, edit) -> None:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    edit(t)
    save_file(t, str(dst / "model.safetensors"))


def _exact_logits(path) -> torch.Tensor:
    ckpt = load_checkpoint(path)
    cfg = validate_checkpoint(ckpt)
    return TinyModel(cfg, shard_weights(cfg, ckpt.tensors), act_dtype=torch.float64).logits([PROMPT])


def test_absent_awq_scale_is_the_identity(ckpt_root, tmp_path):
    """ModelOpt folds AWQ scales into the preceding RMSNorm or linear and writes none for those linears: an absent
    pre_quant_scale serves as ones (as engines initialise it), exactly; a present one is applied (it matters)."""
    src = ckpt_root / checkpoint_name("dense", "NVFP4_AWQ", "a")
    name = "model.layers.0.self_attn.q_proj.pre_quant_scale"
    _edited_copy(src, tmp_path / "ones", lambda t: t.__setitem__(name, torch.ones_like(t[name])))
    _edited_copy(src, tmp_path / "absent", lambda t: t.pop(name))
    assert torch.equal(_exact_logits(tmp_path / "ones"), _exact_logits(tmp_path / "absent"))
    assert not torch.allclose(_exact_logits(src), _exact_logits(tmp_path / "absent"), atol=1e-3)


def test_tied_embeddings_use_the_embedding_as_head(ckpt_root, tmp_path):
    """tie_word_embeddings: ModelOpt writes no lm_head.weight; the head is model.embed_tokens.weight."""
    src = ckpt_root / checkpoint_name("dense", "W4A16_NVFP4", "a")
    _edited_copy(src, tmp_path / "untied", lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    _edited_copy(src, tmp_path / "tied", lambda t: t.pop("lm_head.weight"))
    c = json.loads((tmp_path / "tied" / "config.json").read_text())
    (tmp_path / "tied" / "config.json").write_text(json.dumps({**c, "tie_word_embeddings": True}))
    assert torch.equal(_exact_logits(tmp_path / "untied"), _exact_logits(tmp_path / "tied"))
    with pytest.raises(CheckpointError, match="missing tensor 'lm_head.weight'"):  # untied needs its head
        (tmp_path / "tied" / "config.json").write_text(json.dumps(c))
        validate_checkpoint(load_checkpoint(tmp_path / "tied"))


@pytest.mark.parametrize("case", ["fp8-kv-cache", "float16", "expert-awq-scale"])
def test_unservable_export_is_a_clear_error(ckpt_root, tmp_path, case):
    arch = "moe" if case == "expert-awq-scale" else "dense"
    src = ckpt_root / checkpoint_name(arch, "NVFP4", "a")
    path = tmp_path / "ckpt"
    if case == "fp8-kv-cache":
        shutil.copytree(src, path)
        q = json.loads((path / "hf_quant_config.json").read_text())
        q["quantization"]["kv_cache_quant_algo"] = "FP8"
        (path / "hf_quant_config.json").write_text(json.dumps(q))
        match = "kv_cache_quant_algo 'FP8'.*BF16 KV cache"
    elif case == "float16":
        _edited_copy(src, path, lambda t: t.update({k: v.half() for k, v in t.items() if v.dtype == torch.bfloat16}))
        match = "unquantized tensors are float16.*bfloat16"
    else:
        pqs = "model.layers.0.mlp.experts.3.up_proj.pre_quant_scale"
        _edited_copy(src, path, lambda t: t.__setitem__(pqs, torch.full((256,), 1.5, dtype=torch.bfloat16)))
        match = f"'{pqs}' is an AWQ pre_quant_scale of a MoE expert"
    with pytest.raises(CheckpointError, match=match):
        validate_checkpoint(load_checkpoint(path))


def test_reload_with_another_tensor_set_is_refused(ckpt_root, tmp_path):
    """A reload whose checkpoint holds other tensors (an AWQ scale folded away) fails; nothing is committed."""
    from reference_impl.model import Comm
    from reference_impl.server.engine import Engine, EngineError

    src = ckpt_root / checkpoint_name("dense", "NVFP4_AWQ", "a")
    _edited_copy(src, tmp_path / "folded", lambda t: t.pop("model.layers.1.self_attn.o_proj.pre_quant_scale"))
    engine = Engine(str(src), Layout(), Comm())
    with pytest.raises(EngineError, match="different set of tensors"):
        engine.stage_weights(str(tmp_path / "folded"))


def test_zero_and_negative_zero_block_scales_are_accepted(ckpt_root, tmp_path):
    """A block of zero weights has scale 0 (exporters write 0x00; -0 is the same value): not damage."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "ckpt"
    shutil.copytree(ckpt_root / checkpoint_name("dense", "NVFP4_AWQ", "a"), path)
    t = load_file(str(path / "model.safetensors"))
    codes = t["model.layers.0.mlp.up_proj.weight_scale"].clone().view(torch.uint8)
    codes.view(-1)[:2] = torch.tensor([0x00, 0x80], dtype=torch.uint8)
    t["model.layers.0.mlp.up_proj.weight_scale"] = codes.view(torch.float8_e4m3fn)
    save_file(t, str(path / "model.safetensors"))
    validate_checkpoint(load_checkpoint(path))
