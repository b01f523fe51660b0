"""Random-weight NVFP4 checkpoints of real model shapes for benchmarks/bench_truth.py, written fast enough to
make on the benchmark machine itself (the random packed codes and scales are drawn on the GPU when there is
one; the files are then written at disk speed).

    python benchmarks/make_truth_models.py OUT --shape llama-3.1-8b [--layers N] [--device cuda] [--cold]

Real configs (``config.json`` as the released models write it, depth optionally truncated by ``--layers``),
ModelOpt's NVFP4 layout (``hf_quant_config.json``, LM head excluded); every tensor is the one
:func:`reference_impl.model.architectures.checkpoint_specs` requires, so any architecture the truth supports can be
written. Weights: uniformly random E2M1 codes (every byte pattern is two valid codes), E4M3 block scales in
[0.5, 1), a global scale ``1 / (2.93 * 0.75 * sqrt(in_features))`` (2.93: the RMS of a uniform E2M1 code) so
activations stay O(1); BF16 embeddings N(0, 1), LM head N(0, 4 / hidden), norms ``1 + N(0, 0.01)``.
``--cold``: fsync each file and drop it from the page cache (``posix_fadvise DONTNEED``), so a benchmark
reads it from the disk.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reference_impl.model.architectures import ModelConfig, checkpoint_specs  # noqa: E402
from reference_impl.model.checkpoint import QuantConfig  # noqa: E402

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_act="silu",
              max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000,
              eos_token_id=128001, attention_bias=False, mlp_bias=False, head_dim=128, torch_dtype="bfloat16",
              rope_parameters=_LLAMA3_ROPE, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE)
#: the released models' config.json values (Llama-3.1-8B / 70B, DeepSeek-V3)
SHAPES: dict[str, dict] = {
    "llama-3.1-8b": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8},
    "llama-3.1-70b": {**_LLAMA, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                      "num_attention_heads": 64, "num_key_value_heads": 8},
    "deepseek-v3": dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
        intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
        num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
        topk_method="noaux_tc", n_group=8, topk_group=4, num_experts_per_tok=8, moe_layer_freq=1,
        first_k_dense_replace=3, norm_topk_prob=True, scoring_func="sigmoid", hidden_act="silu",
        max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=1, attention_bias=False, torch_dtype="bfloat16", rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0}),
}
QUANT = QuantConfig("NVFP4", exclude_modules=("lm_head",))
_E2M1_RMS = 2.93  # sqrt(mean of the squared E2M1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6})
_FILE_BYTES = 4 << 30  # shard size


def config_of(shape: str, layers: int | None = None, overrides: dict | None = None) -> dict:
    """The config.json of ``shape``, depth ``layers``; ``overrides``: other values (tests use tiny dimensions)."""
    cfg = json.loads(json.dumps(SHAPES[shape]))
    cfg.update(overrides or {})
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    return cfg


def _tensor(name: str, dtype: torch.dtype, shape: tuple, g: torch.Generator, device: torch.device,
            hidden: int, in_features: dict[str, int]) -> torch.Tensor:
    if dtype == torch.uint8:  # two E2M1 codes per byte: every pattern is valid
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g, device=device)
    if dtype == torch.float8_e4m3fn:
        return (0.5 + 0.5 * torch.rand(shape, generator=g, device=device)).to(dtype)
    if name.endswith("weight_scale_2"):
        k = in_features[name[:-len(".weight_scale_2")]]
        return torch.tensor(1.0 / (_E2M1_RMS * 0.75 * math.sqrt(k)), dtype=torch.float32)
    if name.endswith("input_scale"):
        return torch.tensor(1.0, dtype=torch.float32)
    dt = dtype[-1] if isinstance(dtype, tuple) else dtype  # DeepSeek's router: FP32 as the released checkpoints
    if "norm" in name:
        t = 1 + 0.01 * torch.randn(shape, generator=g, device=device)
    elif name.endswith("e_score_correction_bias"):
        t = 0.01 * torch.randn(shape, generator=g, device=device)
    elif name == "model.embed_tokens.weight":
        t = torch.randn(shape, generator=g, device=device)
    else:  # LM head, router, excluded linears
        t = torch.randn(shape, generator=g, device=device) * (2 / math.sqrt(hidden))
    return t.to(dt)


def write(out: Path, shape: str, layers: int | None = None, device: str | None = None, seed: int = 0,
          cold: bool = False, overrides: dict | None = None) -> Path:
    """Write checkpoint ``out`` of ``shape`` (``layers``: truncated depth); returns ``out``."""
    from safetensors.torch import save_file

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg_json = config_of(shape, layers, overrides)
    cfg = ModelConfig.from_hf(cfg_json)
    specs = checkpoint_specs(cfg, QUANT)
    in_features = {s.name[:-len(".weight")]: 2 * s.shape[1] for s in specs if s.dtype == torch.uint8}
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("*.safetensors"):
        f.unlink()
    g = torch.Generator(device=dev).manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    size, index = 0, {}
    files: list[Path] = []

    def flush():
        nonlocal shard, size
        if shard:
            f = out / f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(f), metadata={"format": "pt"})
            index.update({n: f.name for n in shard})
            files.append(f)
            shard, size = {}, 0

    for s in specs:
        if not s.required and not s.name.endswith("input_scale"):
            continue
        t = _tensor(s.name, s.dtype, tuple(s.shape), g, dev, cfg.hidden_size, in_features).cpu()
        shard[s.name] = t
        size += t.numel() * t.element_size()
        if size >= _FILE_BYTES:
            flush()
    flush()
    (out / "config.json").write_text(json.dumps(cfg_json, indent=2))
    (out / "hf_quant_config.json").write_text(json.dumps(QUANT.as_hf_quant_config(), indent=2))
    total = sum(f.stat().st_size for f in files)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": index}, indent=1))
    if cold:
        drop_page_cache(files)
    return out


def drop_page_cache(files) -> None:
    """fsync and evict ``files`` from the page cache (the next read comes from the disk)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def view(src: Path, dst: Path, layers: int) -> Path:
    """A checkpoint directory ``dst`` of the first ``layers`` layers of ``src`` (its files linked, the config
    truncated): the truth reads only the tensors of the layers the config has."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.glob("*.safetensors"):
        link = dst / f.name
        if not link.exists():
            link.symlink_to(f.resolve())
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    (dst / "hf_quant_config.json").write_text((src / "hf_quant_config.json").read_text())
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="truncated depth (default: the model's)")
    ap.add_argument("--device", default=None, help="where the random tensors are drawn (default: cuda if available)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cold", action="store_true", help="evict the written files from the page cache")
    a = ap.parse_args()
    write(a.out, a.shape, a.layers, a.device, a.seed, a.cold)
    print(f"wrote {a.out} ({sum(f.stat().st_size for f in a.out.glob('*.safetensors')) / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
