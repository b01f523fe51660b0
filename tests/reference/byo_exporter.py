"""An independent NVFP4 exporter: a tiny float Llama or Qwen3-MoE quantized and written in ModelOpt's Hugging
Face export layout by code that shares nothing with fixtures/make_checkpoints.py or reference_impl/
(numpy + ml_dtypes for the E2M1/E4M3 casts, safetensors' numpy writer, sharded files with an index, no
tokenizer.json: what ``modelopt.torch.export.export_hf_checkpoint`` writes for NVFP4 / W4A16_NVFP4).

    python tests/reference/byo_exporter.py OUT [--arch llama|qwen3_moe] [--algo NVFP4|W4A16_NVFP4] [--tokenizer-dir DIR]

The quantization is ModelOpt's weight recipe written from its definition: per-tensor
``weight_scale_2 = amax / (6 * 448)``, per 16-element block ``scale = e4m3(block_amax / 6 / weight_scale_2)``,
codes ``e2m1(w / (scale * weight_scale_2))`` (round to nearest even), two codes per byte, element ``2i``
in the low nibble.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import ml_dtypes
import numpy as np

E2M1_MAX, E4M3_MAX, BLOCK = 6.0, 448.0, 16
WORDS = ("<pad> <s> </s> <unk> the of and to in is was for on that with as by at from a new river old stone tree "
         "music sea moon people north city water light dark sun star bird cold warm red blue green house life "
         "long small high south work time year world game team song road hill rain snow wind fire gold iron "
         "ship port king queen land field book page word name day night home door wall hand eye face heart "
         "mind voice sound color shape line point edge side top end way part place room table chair bed floor "
         "glass paper stone wood metal cloth bread milk tea fish meat rice fruit apple leaf root seed flower "
         "grass farm town bridge tower gate garden park lake pond shore wave cloud sky").split()
WORDS = tuple(dict.fromkeys(WORDS))  # unique, in order
VOCAB = 128


def quantize_nvfp4(w: np.ndarray) -> dict[str, np.ndarray]:
    """ModelOpt's NVFP4 weight recipe for one [N, K] float32 weight."""
    n, k = w.shape
    ws2 = np.float32(np.abs(w).max() / (E2M1_MAX * E4M3_MAX))
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    scale = (np.abs(blocks).max(axis=-1) / E2M1_MAX / ws2).astype(ml_dtypes.float8_e4m3fn)
    denom = scale.astype(np.float32)[..., None] * ws2
    scaled = np.divide(blocks, denom, out=np.zeros_like(blocks), where=denom != 0)
    codes = scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8).reshape(n, k) & 0xF
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return {"weight": packed, "weight_scale": scale, "weight_scale_2": np.array(ws2, dtype=np.float32)}


def config(arch: str, vocab: int) -> dict:
    cfg = {"vocab_size": vocab, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "hidden_act": "silu",
           "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
    if arch == "llama":
        cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
    else:
        cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", moe_intermediate_size=64,
                   num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                   mlp_only_layers=[])
    return cfg


def float_model(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, v, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def lin(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((v, h)).astype(np.float32),
         "model.norm.weight": (1 + 0.1 * rng.standard_normal(h)).astype(np.float32),
         "lm_head.weight": (2.5 * lin(v, h))}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        w[f"{p}.post_attention_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        for name, rows, cols in (("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q)):
            w[f"{p}.self_attn.{name}.weight"] = lin(rows, cols)
        if cfg["model_type"] == "llama":
            i_ = cfg["intermediate_size"]
            for name, rows, cols in (("gate_proj", i_, h), ("up_proj", i_, h), ("down_proj", h, i_)):
                w[f"{p}.mlp.{name}.weight"] = lin(rows, cols)
        else:
            w[f"{p}.self_attn.q_norm.weight"] = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32)
            w[f"{p}.self_attn.k_norm.weight"] = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32)
            w[f"{p}.mlp.gate.weight"] = lin(cfg["num_experts"], h)
            m = cfg["moe_intermediate_size"]
            for e in range(cfg["num_experts"]):
                for name, rows, cols in (("gate_proj", m, h), ("up_proj", m, h), ("down_proj", h, m)):
                    w[f"{p}.mlp.experts.{e}.{name}.weight"] = lin(rows, cols)
    return w


def export(out: Path, arch: str = "llama", algo: str = "NVFP4", vocab: int | None = None, seed: int = 7,
           tokenizer_dir: Path | None = None) -> Path:
    """Write the checkpoint (two shards + index, no tokenizer) and, if asked, a tokenizer directory."""
    vocab = vocab or VOCAB
    cfg = config(arch, vocab)
    excluded = ["lm_head"] + (["model.layers.*.mlp.gate"] if arch == "qwen3_moe" else [])
    tensors: dict[str, np.ndarray] = {}
    for name, w in float_model(cfg, seed).items():
        prefix = name[: -len(".weight")]
        if name.endswith("_proj.weight"):
            for field, t in quantize_nvfp4(w).items():
                tensors[f"{prefix}.{field}"] = t
            if algo == "NVFP4":  # W4A4 activation scale (amax 10 assumed); W4A16 has none
                tensors[f"{prefix}.input_scale"] = np.array(10.0 / (E2M1_MAX * E4M3_MAX), dtype=np.float32)
        else:
            tensors[name] = w.astype(ml_dtypes.bfloat16)
    _write_shards(out, tensors)
    quant = {"quant_algo": algo, "kv_cache_quant_algo": None, "group_size": BLOCK, "exclude_modules": excluded}
    (out / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt", "version": "0.47.0"}, "quantization": quant}, indent=4))
    cfg["quantization_config"] = {"quant_method": "modelopt", **quant, "ignore": excluded}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    if tokenizer_dir is not None:
        write_tokenizer(tokenizer_dir, vocab)
    return out


def _write_shards(out: Path, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: np.ascontiguousarray(tensors[n]) for n in part}, str(out / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    total = sum(t.nbytes for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=2))


def write_tokenizer(path: Path, vocab: int) -> Path:
    """A word-level tokenizer.json with ``vocab`` entries (it must not exceed the model's vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = (list(WORDS) + [f"w{i}" for i in range(vocab)])[:vocab]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--arch", choices=("llama", "qwen3_moe"), default="llama")
    ap.add_argument("--algo", choices=("NVFP4", "W4A16_NVFP4"), default="NVFP4")
    ap.add_argument("--tokenizer-dir", type=Path, default=None)
    a = ap.parse_args()
    print(export(a.out, a.arch, a.algo, tokenizer_dir=a.tokenizer_dir))
