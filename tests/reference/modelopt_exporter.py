"""Real ModelOpt exports for the self-tests, made at test time (nothing ModelOpt writes is committed).

A tiny randomly initialised ``transformers`` model (Llama, Qwen3, Qwen3-MoE, Mixtral or DeepSeek-V3) is quantized on CPU with
``modelopt.torch.quantization`` (a short calibration loop over random token ids) and written by
``modelopt.torch.export.export_hf_checkpoint``: the files a vendor brings.

    python tests/reference/modelopt_exporter.py OUT [--arch llama|qwen3|qwen3_moe|mixtral|deepseek_v3] [--algo NVFP4|NVFP4_AWQ|W4A16_NVFP4]
                                          [--tied] [--shard-size 200KB] [--fp8-kv] [--float16] [--size small|tiny]

What running ModelOpt 0.47.0 on CPU (transformers 5.24) showed, and what this module does about it:

* ``NVFP4`` (``NVFP4_DEFAULT_CFG``) and ``W4A16_NVFP4`` (``W4A16_NVFP4_CFG``): max calibration runs on CPU.
* ``NVFP4_AWQ``: ModelOpt's AWQ scale *search* (``NVFP4_AWQ_LITE_CFG``) fake-quantizes weights, and its NVFP4
  fake quantization asserts a CUDA tensor ("amax must be a CUDA tensor for dynamic block quantization"). Here
  the model is max-calibrated with ``NVFP4_DEFAULT_CFG`` and each quantized linear then gets an AWQ scale
  through ModelOpt's own ``apply_pre_quant_scale_and_smooth`` (what its AWQ-lite post-processing calls), with
  the AWQ paper's scale ``s_j = sqrt(max|x_j| / max|w_.j|)`` (normalised to mean 1) instead of the searched
  one; the export (folding the scales into the RMSNorms and the preceding linears) is ModelOpt's.
  MoE: ModelOpt 0.47's AWQ export fails on transformers 5's fused experts (``QuantQwen3MoeExperts`` has no
  ``len()``), so ``qwen3_moe`` + ``NVFP4_AWQ`` raises.
* ``export_hf_checkpoint`` needs ``config.architectures`` (a TypeError otherwise): set here.
* ``initializer_range`` 0.1 instead of transformers' 0.02: a random 0.02 model's logits lie within about 0.1
  of each other, so almost every greedy step is a near tie the golden comparison must let pass; at 0.1 the
  top-2 logit gaps (0.2-1.4) are of the order of the bounds, like a trained model's decisive steps.
"""
from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 128, 256, 2, 4, 2, 64
INIT_RANGE = 0.1
ALGOS = ("NVFP4", "NVFP4_AWQ", "W4A16_NVFP4")


ARCHS = ("llama", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3")
#: model sizes: ``small`` (the default: the ModelOpt self-tests' exports) and ``tiny`` (hidden 64: the scenario
#: suite on every architecture in CI, where the reference's golden truth and near-tie branches dominate the time)
SIZES = {"small": dict(hidden=HIDDEN, head_dim=HEAD_DIM, inter=512, moe_inter=128, rank=64, mla_dim=32),
         "tiny": dict(hidden=64, head_dim=16, inter=128, moe_inter=32, rank=32, mla_dim=16)}
#: DeepSeek-V3's rotary scaling (YaRN, as the real model's config writes it) at a tiny original context
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def _model(arch: str, tied: bool, dtype: torch.dtype, seed: int, size: str = "small"):
    import transformers

    torch.manual_seed(seed)
    z = SIZES[size]
    inter, moe_inter, rank, mla_dim = z["inter"], z["moe_inter"], z["rank"], z["mla_dim"]
    common = dict(vocab_size=VOCAB, hidden_size=z["hidden"], num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, head_dim=z["head_dim"], max_position_embeddings=256, rms_norm_eps=1e-6,
                  initializer_range=INIT_RANGE, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=inter, **common))
    elif arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(intermediate_size=inter, **common))
    elif arch == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            intermediate_size=inter, moe_intermediate_size=moe_inter, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, decoder_sparse_step=1, **common))
    elif arch == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            intermediate_size=moe_inter, num_local_experts=8, num_experts_per_tok=2, **common))
    elif arch == "deepseek_v3":
        mla = {**{k: v for k, v in common.items() if k != "head_dim"}, "num_key_value_heads": HEADS}  # MLA: per-head keys
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            intermediate_size=inter, moe_intermediate_size=moe_inter, n_routed_experts=16, num_experts_per_tok=4,
            n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
            q_lora_rank=rank, kv_lora_rank=rank, qk_nope_head_dim=mla_dim, qk_rope_head_dim=mla_dim,
            v_head_dim=mla_dim, rope_parameters=DEEPSEEK_YARN,
            **mla))
        g = torch.Generator().manual_seed(seed + 1)
        for layer in model.model.layers:  # transformers initialises the score correction to zeros: make it matter
            if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "e_score_correction_bias"):
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.05)
    else:
        raise ValueError(f"arch {arch!r} is not one of {ARCHS}")
    if size == "tiny":  # transformers initialises every RMSNorm weight to ones: a reader ignoring them would pass
        g = torch.Generator().manual_seed(seed + 2)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    model.config.architectures = [type(model).__name__]
    return model.to(dtype).eval()


def _calibrate(model, batches: int = 4) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(batches):
        model(torch.randint(0, VOCAB, (2, 32), generator=g))


def _apply_awq_scales(model) -> int:
    """AWQ scales on every enabled quantized linear, applied by ModelOpt (see the module docstring)."""
    from modelopt.torch.quantization.model_calib import apply_pre_quant_scale_and_smooth
    from modelopt.torch.quantization.nn import TensorQuantizer
    from modelopt.torch.quantization.utils import is_quantized_linear

    linears = {n: m for n, m in model.named_modules() if is_quantized_linear(m) and m.weight_quantizer.is_enabled}
    act_amax: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(_module, args):
            a = args[0].detach().abs().float().reshape(-1, args[0].shape[-1]).amax(0)
            act_amax[name] = torch.maximum(act_amax[name], a) if name in act_amax else a
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    enabled = [q for q in model.modules() if isinstance(q, TensorQuantizer) and q.is_enabled]
    for q in enabled:  # float activations for the statistics
        q.disable()
    try:
        _calibrate(model)
    finally:
        for q in enabled:
            q.enable()
        for h in handles:
            h.remove()
    for name, m in linears.items():
        if name not in act_amax:  # an expert no calibration token reached
            continue
        s = (act_amax[name].clamp(min=1e-4) / m.weight.float().abs().amax(0).clamp(min=1e-4)).sqrt()
        s = s / s.mean()
        # ModelOpt's AWQ post-processing records the per-channel activation maximum under this name before
        # applying a scale (it then re-derives the input quantizer's global amax from it)
        m.input_quantizer._amax_for_smoothing = act_amax[name].cpu()
        apply_pre_quant_scale_and_smooth(m, 1.0 / s)  # input * pre_quant_scale, weight / pre_quant_scale
    return len(linears)


def export(out: Path, arch: str = "llama", algo: str = "W4A16_NVFP4", *, tied: bool = False,
           shard_size: str | None = None, fp8_kv: bool = False, dtype: torch.dtype = torch.bfloat16,
           seed: int = 0, size: str = "small") -> Path:
    """Quantize a fresh tiny model with ModelOpt and export it into ``out`` (created); returns ``out``."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    if algo not in ALGOS:
        raise ValueError(f"algo {algo!r} is not one of {ALGOS}")
    if algo == "NVFP4_AWQ" and arch not in ("llama", "qwen3"):
        raise ValueError("ModelOpt 0.47's NVFP4_AWQ export fails on transformers 5's fused MoE experts")
    model = _model(arch, tied, dtype, seed, size)
    cfg = mtq.W4A16_NVFP4_CFG if algo == "W4A16_NVFP4" else mtq.NVFP4_DEFAULT_CFG
    if fp8_kv:
        cfg = {**cfg, "quant_cfg": list(cfg["quant_cfg"]) + list(mtq.FP8_KV_CFG["quant_cfg"])}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # ModelOpt warns that transformers 5.24 is untested
        mtq.quantize(model, cfg, forward_loop=_calibrate)
        if algo == "NVFP4_AWQ":
            _apply_awq_scales(model)
        out.mkdir(parents=True, exist_ok=True)
        with torch.inference_mode():
            export_hf_checkpoint(model, export_dir=out, **({"max_shard_size": shard_size} if shard_size else {}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--arch", default="llama", choices=ARCHS)
    ap.add_argument("--algo", default="W4A16_NVFP4", choices=ALGOS)
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--shard-size", default=None)
    ap.add_argument("--fp8-kv", action="store_true")
    ap.add_argument("--float16", action="store_true")
    ap.add_argument("--size", default="small", choices=tuple(SIZES))
    a = ap.parse_args()
    export(a.out, a.arch, a.algo, tied=a.tied, shard_size=a.shard_size, fp8_kv=a.fp8_kv,
           dtype=torch.float16 if a.float16 else torch.bfloat16, size=a.size)
    print(a.out)


if __name__ == "__main__":
    main()
