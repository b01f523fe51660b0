"""The model architectures the reference serves and judges: what a checkpoint's ``config.json`` means, which
tensors it must hold, and how they split over tensor / expert parallel ranks.

Supported (``architectures`` in ``config.json``): ``LlamaForCausalLM``, ``Qwen3ForCausalLM`` (q/k norms),
``Qwen3MoeForCausalLM`` (dense layers where ``mlp_only_layers`` / ``decoder_sparse_step`` say so),
``MixtralForCausalLM`` (both expert namings: ``block_sparse_moe.experts.<e>.w1/w3/w2``, as ModelOpt and the
original checkpoints write them, and ``mlp.experts.<e>.gate_proj/up_proj/down_proj``) and
``DeepseekV3ForCausalLM`` (multi-head latent attention, rotary part interleaved, YaRN; the first
``first_k_dense_replace`` layers dense, then MoE with shared experts and sigmoid scores, the expert choice by
``score + e_score_correction_bias`` restricted to the ``topk_group`` best of ``n_group`` groups, weights
renormalised and times ``routed_scaling_factor``; Kimi-K2 and DeepSeek-R1 are this architecture). Refused with
the reason: :data:`REFUSED`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from reference_impl.model.checkpoint import Checkpoint, CheckpointError, QuantConfig, TensorSpec, check_tensors, linear_specs
from reference_impl.format.nvfp4 import BLOCK_SIZE

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
                 "MixtralForCausalLM": "mixtral", "DeepseekV3ForCausalLM": "deepseek_v3"}
#: transformers' model_type of each architecture (its config class reads the rest of config.json)
MODEL_TYPES = {"llama": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral",
               "deepseek_v3": "deepseek_v3"}
REFUSED = {
    "NemotronHForCausalLM": (
        "hybrid Mamba-2 / attention layers: the Mamba-2 mixer (causal conv1d, selective state-space scan with "
        "exponentiated cumulative decays, gated RMSNorm) stores intermediates the reference's rounding model does "
        "not describe (reference_impl/truth/golden.py lists the stores it bounds), and the reference server has no BF16 "
        "Mamba-2 path, so neither golden outputs with derived bounds nor a reference engine exist for it"),
    "DeepseekV2ForCausalLM": "DeepSeek-V2 routing (softmax group-limited, no score correction) is not implemented",
    "DeepseekV32ForCausalLM": "DeepSeek-V3.2's sparse attention indexer is not implemented",
}
EXPERT_NAMES = {"gate_proj": ("gate_proj", "up_proj", "down_proj"), "w1": ("w1", "w3", "w2")}


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    eos_token_id: int | None = None
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = False  # lm_head is model.embed_tokens (ModelOpt then writes no lm_head.weight)
    qk_norm: bool = False              # Qwen3: RMSNorm over each head of q and k before the rotary embedding
    moe_layers: tuple[int, ...] = ()   # layers whose MLP is a mixture of experts
    moe_prefix: str = "mlp"            # "block_sparse_moe" in Mixtral's original naming
    expert_names: tuple[str, str, str] = EXPERT_NAMES["gate_proj"]  # (gate, up, down)
    router: str = "softmax"            # "softmax" (top-k of softmax) or "sigmoid_grouped" (DeepSeek-V3)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    # multi-head latent attention (DeepSeek-V3); q_lora_rank 0: a plain q_proj
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)  # config.json as read

    @property
    def is_mla(self) -> bool:
        return self.arch == "deepseek_v3"

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    def expert(self, layer: int, e: int, which: int) -> str:
        """Prefix of expert ``e``'s linear ``which`` (0 gate, 1 up, 2 down) in layer ``layer``."""
        return f"model.layers.{layer}.{self.moe_prefix}.experts.{e}.{self.expert_names[which]}"

    def router_prefix(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.moe_prefix}.gate"

    def mlp_prefix(self, layer: int) -> str:
        return f"model.layers.{layer}.mlp"

    @classmethod
    def from_hf(cls, cfg: dict, names: set[str] | None = None) -> "ModelConfig":
        """``names``: the checkpoint's tensor names (they tell Mixtral's two expert namings apart)."""
        archs = cfg.get("architectures") or []
        refused = [a for a in archs if a in REFUSED]
        if refused:
            raise CheckpointError(f"config.json: architecture {refused[0]} is not supported: {REFUSED[refused[0]]}")
        arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise CheckpointError(f"config.json: architectures {archs} not supported (supported: {sorted(ARCHITECTURES)})")
        try:
            return cls(**_fields(arch, cfg, names or set()), hf_config=dict(cfg))
        except KeyError as exc:
            raise CheckpointError(f"config.json: missing key {exc.args[0]!r}") from exc


def _rope_theta(cfg: dict) -> float:
    return float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))


def rope_parameters(cfg: dict) -> dict:
    """The rotary parameters as transformers 5 reads them (``rope_parameters``, or the older ``rope_scaling``)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", _rope_theta(cfg))
    return params


def _fields(arch: str, cfg: dict, names: set[str]) -> dict:
    heads = cfg["num_attention_heads"]
    out = dict(arch=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
               num_layers=cfg["num_hidden_layers"], num_heads=heads,
               num_kv_heads=cfg.get("num_key_value_heads") or heads,
               head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
               intermediate_size=cfg.get("intermediate_size", 0), rope_theta=_rope_theta(cfg),
               rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), eos_token_id=cfg.get("eos_token_id"),
               max_position_embeddings=int(cfg.get("max_position_embeddings", 256)),
               tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    layers = range(out["num_layers"])
    if arch in ("qwen3", "qwen3_moe"):
        out["qk_norm"] = True
    if arch == "qwen3_moe":
        experts = cfg.get("num_experts") or cfg["num_local_experts"]
        dense, step = set(cfg.get("mlp_only_layers") or []), int(cfg.get("decoder_sparse_step", 1) or 1)
        out.update(num_experts=experts, top_k=cfg["num_experts_per_tok"],
                   moe_intermediate_size=cfg["moe_intermediate_size"],
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                   moe_layers=tuple(i for i in layers if i not in dense and experts > 0 and (i + 1) % step == 0))
    elif arch == "mixtral":
        legacy = any(".block_sparse_moe." in n for n in names)
        out.update(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                   moe_intermediate_size=cfg["intermediate_size"], moe_layers=tuple(layers),
                   moe_prefix="block_sparse_moe" if legacy else "mlp",
                   expert_names=EXPERT_NAMES["w1" if legacy or any(".experts.0.w1." in n for n in names) else "gate_proj"])
    elif arch == "deepseek_v3":
        if cfg.get("topk_method", "noaux_tc") != "noaux_tc" or cfg.get("scoring_func", "sigmoid") != "sigmoid":
            raise CheckpointError(f"config.json: DeepSeek-V3 routing topk_method {cfg.get('topk_method')!r} / "
                                  f"scoring_func {cfg.get('scoring_func')!r}: only noaux_tc with sigmoid scores is supported")
        if int(cfg.get("moe_layer_freq", 1)) != 1:
            raise CheckpointError("config.json: moe_layer_freq other than 1 is not supported")
        first_dense = int(cfg.get("first_k_dense_replace", 0))
        experts = cfg.get("n_routed_experts") or cfg["num_local_experts"]
        out.update(num_kv_heads=heads, head_dim=cfg["qk_rope_head_dim"], num_experts=experts,
                   top_k=cfg["num_experts_per_tok"], moe_intermediate_size=cfg["moe_intermediate_size"],
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                   moe_layers=tuple(i for i in layers if i >= first_dense), router="sigmoid_grouped",
                   n_group=int(cfg.get("n_group") or 1), topk_group=int(cfg.get("topk_group") or 1),
                   routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                   n_shared_experts=int(cfg.get("n_shared_experts") or 0), q_lora_rank=int(cfg.get("q_lora_rank") or 0),
                   kv_lora_rank=cfg["kv_lora_rank"], qk_nope_head_dim=cfg["qk_nope_head_dim"],
                   qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
                   rope_interleave=bool(cfg.get("rope_interleave", True)))
        if experts % out["n_group"]:
            raise CheckpointError(f"config.json: n_routed_experts {experts} is not a multiple of n_group {out['n_group']}")
    return out


# ----------------------------------------------------------------------------------------- tensors
def attention_linears(cfg: ModelConfig, i: int) -> list[tuple[str, int, int]]:
    """(prefix, out_features, in_features) of layer ``i``'s attention linears."""
    p, h = f"model.layers.{i}.self_attn", cfg.hidden_size
    if cfg.is_mla:
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        q = ([(f"{p}.q_a_proj", cfg.q_lora_rank, h), (f"{p}.q_b_proj", cfg.num_heads * qk, cfg.q_lora_rank)]
             if cfg.q_lora_rank else [(f"{p}.q_proj", cfg.num_heads * qk, h)])
        return q + [(f"{p}.kv_a_proj_with_mqa", cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
                    (f"{p}.kv_b_proj", cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                    (f"{p}.o_proj", h, cfg.num_heads * cfg.v_head_dim)]
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [(f"{p}.q_proj", q, h), (f"{p}.k_proj", kv, h), (f"{p}.v_proj", kv, h), (f"{p}.o_proj", h, q)]


def mlp_linears(prefix: str, inter: int, h: int, names=EXPERT_NAMES["gate_proj"]) -> list[tuple[str, int, int]]:
    gate, up, down = names
    return [(f"{prefix}.{gate}", inter, h), (f"{prefix}.{up}", inter, h), (f"{prefix}.{down}", h, inter)]


def linear_names(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(prefix, out_features, in_features) of every linear that may be quantized."""
    h, out = cfg.hidden_size, []
    for i in range(cfg.num_layers):
        out += attention_linears(cfg, i)
        if not cfg.is_moe(i):
            out += mlp_linears(cfg.mlp_prefix(i), cfg.intermediate_size, h)
            continue
        for e in range(cfg.num_experts):
            out += [(cfg.expert(i, e, w), *dims) for w, dims in
                    enumerate(((cfg.moe_intermediate_size, h), (cfg.moe_intermediate_size, h), (h, cfg.moe_intermediate_size)))]
        if cfg.n_shared_experts:
            out += mlp_linears(f"{cfg.mlp_prefix(i)}.shared_experts", cfg.moe_intermediate_size * cfg.n_shared_experts, h)
    return out


def norm_specs(cfg: ModelConfig, i: int) -> list[TensorSpec]:
    bf16, h, p = torch.bfloat16, cfg.hidden_size, f"model.layers.{i}"
    specs = [TensorSpec(f"{p}.input_layernorm.weight", bf16, (h,)),
             TensorSpec(f"{p}.post_attention_layernorm.weight", bf16, (h,))]
    if cfg.qk_norm:
        specs += [TensorSpec(f"{p}.self_attn.q_norm.weight", bf16, (cfg.head_dim,)),
                  TensorSpec(f"{p}.self_attn.k_norm.weight", bf16, (cfg.head_dim,))]
    if cfg.is_mla:
        if cfg.q_lora_rank:
            specs.append(TensorSpec(f"{p}.self_attn.q_a_layernorm.weight", bf16, (cfg.q_lora_rank,)))
        specs.append(TensorSpec(f"{p}.self_attn.kv_a_layernorm.weight", bf16, (cfg.kv_lora_rank,)))
    return specs


def router_specs(cfg: ModelConfig, i: int) -> list[TensorSpec]:
    if not cfg.is_moe(i):
        return []
    p = cfg.router_prefix(i)
    if cfg.router == "sigmoid_grouped":  # written in BF16 or FP32 (the original checkpoints keep FP32)
        return [TensorSpec(f"{p}.weight", (torch.bfloat16, torch.float32), (cfg.num_experts, cfg.hidden_size)),
                TensorSpec(f"{p}.e_score_correction_bias", (torch.bfloat16, torch.float32), (cfg.num_experts,))]
    return [TensorSpec(f"{p}.weight", torch.bfloat16, (cfg.num_experts, cfg.hidden_size))]


def checkpoint_specs(cfg: ModelConfig, quant: QuantConfig) -> list[TensorSpec]:
    """Every tensor a checkpoint of ``cfg`` must hold, with dtype and shape."""
    bf16, h = torch.bfloat16, cfg.hidden_size
    specs = [TensorSpec("model.embed_tokens.weight", bf16, (cfg.vocab_size, h)),
             TensorSpec("model.norm.weight", bf16, (h,)),
             TensorSpec("lm_head.weight", bf16, (cfg.vocab_size, h), required=not cfg.tie_word_embeddings)]
    for i in range(cfg.num_layers):
        specs += norm_specs(cfg, i) + router_specs(cfg, i)
    for prefix, n, k in linear_names(cfg):
        specs += linear_specs(prefix, n, k, quant, awq_applies=".experts." not in prefix)
    return specs


def validate_checkpoint(ckpt: Checkpoint) -> ModelConfig:
    """The model config of ``ckpt`` after checking every tensor it needs (clear error otherwise)."""
    cfg = ModelConfig.from_hf(ckpt.hf_config, set(ckpt.tensors))
    check_servable(cfg, ckpt.path, ckpt.quant, ckpt.tensors)
    check_tensors(ckpt.tensors, checkpoint_specs(cfg, ckpt.quant), source=ckpt.path)
    return cfg


def check_servable(cfg: ModelConfig, path: str, quant: QuantConfig, tensors) -> None:
    """What a real export may hold that this W4A16 reference cannot serve faithfully: a clear error each.
    ``tensors``: a mapping name -> tensor (or anything with ``dtype``; values are read only for AWQ scales)."""
    if quant.kv_cache_quant_algo is not None:
        raise CheckpointError(
            f"{path}: kv_cache_quant_algo {quant.kv_cache_quant_algo!r}: the checkpoint asks engines for a "
            f"quantized KV cache (k_scale / v_scale); the reference serves W4A16 NVFP4 with a BF16 KV cache, so its golden "
            f"outputs and bounds would not hold: export without KV-cache quantization")
    embed = tensors.get("model.embed_tokens.weight")
    if embed is not None and embed.dtype == torch.float16:
        raise CheckpointError(
            f"{path}: the unquantized tensors are float16 (model.embed_tokens.weight); W4A16 NVFP4 means BF16 "
            f"activations and BF16 unquantized weights: quantize and export the model in bfloat16 "
            f"(model.to(torch.bfloat16) before modelopt.torch.quantization.quantize)")
    if quant.is_excluded("lm_head") is False and "lm_head.weight" in tensors and tensors["lm_head.weight"].dtype == torch.uint8:
        raise CheckpointError(f"{path}: lm_head is quantized; the reference serves a BF16 LM head (ModelOpt excludes it)")
    for name in tensors:
        # engines apply pre_quant_scale in dense linears only (SGLang 0.5.23's NVFP4 MoE method has none), and so
        # does the reference: an expert scale other than ones would be silently dropped by both
        if ".experts." in name and name.endswith(".pre_quant_scale") and not bool((tensors[name].float() == 1).all()):
            raise CheckpointError(
                f"{path}: tensor {name!r} is an AWQ pre_quant_scale of a MoE expert with values other than 1; "
                f"neither engines' MoE paths nor the reference apply it, so no engine can serve this checkpoint as "
                f"written")


# ----------------------------------------------------------------------------------------- sharding
@dataclass(frozen=True)
class Layout:
    """Which slice of the model this rank holds. Attention and dense MLPs are tensor-parallel over
    ``attn_size`` ranks; MoE experts are split over ``ep_size`` ranks (contiguous ranges) and each expert's
    intermediate dimension over ``moe_tp_size`` ranks."""

    attn_rank: int = 0
    attn_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    moe_tp_rank: int = 0
    moe_tp_size: int = 1


def _split(total: int, parts: int, rank: int, what: str, unit: int = 1) -> slice:
    if total % parts or (total // parts) % unit:
        raise CheckpointError(f"{what} = {total} cannot be split into {parts} parts of a multiple of {unit}")
    size = total // parts
    return slice(rank * size, (rank + 1) * size)


def _slice_linear(t: dict, prefix: str, rows: slice | None, cols: slice | None) -> dict[str, torch.Tensor]:
    """The [rows, cols] block of linear ``prefix`` (cols in unpacked K units, multiples of 16)."""
    w = t[f"{prefix}.weight"]
    out: dict[str, torch.Tensor] = {}
    if w.dtype != torch.uint8:  # excluded (unquantized) linear
        out["weight"] = w[rows or slice(None)][:, cols or slice(None)]
        return {k: v.contiguous().clone() for k, v in out.items()}
    packed_cols = slice(cols.start // 2, cols.stop // 2) if cols else slice(None)
    scale_cols = slice(cols.start // BLOCK_SIZE, cols.stop // BLOCK_SIZE) if cols else slice(None)
    out["weight"] = w[rows or slice(None)][:, packed_cols]
    out["weight_scale"] = t[f"{prefix}.weight_scale"][rows or slice(None)][:, scale_cols]
    out["weight_scale_2"] = t[f"{prefix}.weight_scale_2"].float().reshape(())
    pqs = t.get(f"{prefix}.pre_quant_scale") if ".experts." not in prefix else None  # MoE: no AWQ (as engines)
    if pqs is not None:
        out["pre_quant_scale"] = pqs[cols or slice(None)]
    return {k: v.contiguous().clone() for k, v in out.items()}


def _head_rows(cfg: ModelConfig, a: Layout) -> tuple[slice, slice]:
    """This rank's query-head and key/value-head ranges (KV heads replicated beyond their count)."""
    q_rows = _split(cfg.num_heads, a.attn_size, a.attn_rank, "attention heads")
    if cfg.num_kv_heads < a.attn_size and a.attn_size % cfg.num_kv_heads == 0:
        kv = a.attn_rank // (a.attn_size // cfg.num_kv_heads)
        return q_rows, slice(kv, kv + 1)
    return q_rows, _split(cfg.num_kv_heads, a.attn_size, a.attn_rank, "key/value heads")


def _scaled(s: slice, unit: int) -> slice:
    return slice(s.start * unit, s.stop * unit)


def shard_weights(cfg: ModelConfig, tensors: dict[str, torch.Tensor], layout: Layout = Layout(),
                  device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Flat dict ``<linear>.<field>`` / ``<param>`` of this rank's slice, on ``device``."""
    out: dict[str, torch.Tensor] = {}
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        out[name] = tensors[name]
    out["lm_head.weight"] = tensors["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    a = layout
    heads, kv_heads = _head_rows(cfg, a)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        for spec in norm_specs(cfg, i) + router_specs(cfg, i):
            out[spec.name] = tensors[spec.name]
        att = f"{p}.self_attn"
        if cfg.is_mla:  # heads split; the latent projections (q_a, kv_a) replicated on every rank
            qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            parts = {"self_attn.kv_a_proj_with_mqa": (None, None),
                     "self_attn.kv_b_proj": (_scaled(heads, cfg.qk_nope_head_dim + cfg.v_head_dim), None),
                     "self_attn.o_proj": (None, _scaled(heads, cfg.v_head_dim))}
            if cfg.q_lora_rank:
                parts.update({"self_attn.q_a_proj": (None, None), "self_attn.q_b_proj": (_scaled(heads, qk), None)})
            else:
                parts["self_attn.q_proj"] = (_scaled(heads, qk), None)
        else:
            hd = cfg.head_dim
            parts = {"self_attn.q_proj": (_scaled(heads, hd), None), "self_attn.k_proj": (_scaled(kv_heads, hd), None),
                     "self_attn.v_proj": (_scaled(kv_heads, hd), None), "self_attn.o_proj": (None, _scaled(heads, hd))}
        del att
        dense = []
        if not cfg.is_moe(i):
            dense.append(("mlp", cfg.intermediate_size))
        elif cfg.n_shared_experts:
            dense.append(("mlp.shared_experts", cfg.moe_intermediate_size * cfg.n_shared_experts))
        for name, inter in dense:
            cols = _split(inter, a.attn_size, a.attn_rank, f"{name} intermediate size", BLOCK_SIZE)
            parts.update({f"{name}.gate_proj": (cols, None), f"{name}.up_proj": (cols, None),
                          f"{name}.down_proj": (None, cols)})
        for lin, (rows, cols) in parts.items():
            for field_name, v in _slice_linear(tensors, f"{p}.{lin}", rows, cols).items():
                out[f"{p}.{lin}.{field_name}"] = v
        if cfg.is_moe(i):
            experts = _split(cfg.num_experts, a.ep_size, a.ep_rank, "num_experts")
            inter = _split(cfg.moe_intermediate_size, a.moe_tp_size, a.moe_tp_rank, "moe_intermediate_size", BLOCK_SIZE)
            for e in range(experts.start, experts.stop):
                for w, (rows, cols) in enumerate(((inter, None), (inter, None), (None, inter))):
                    prefix = cfg.expert(i, e, w)
                    for field_name, v in _slice_linear(tensors, prefix, rows, cols).items():
                        out[f"{prefix}.{field_name}"] = v
    return {k: v.to(device) for k, v in out.items()}
