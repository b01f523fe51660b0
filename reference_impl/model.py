"""A tiny decoder-only transformer (Llama or Qwen3-MoE architecture) whose linear layers run the reference
W4A16 math, for the server scenarios (SPEC.md section 6).

Precision conventions follow the Hugging Face implementations the fixtures are checked against: RMSNorm
statistics, rotary angles, attention softmax and the MoE router softmax are computed in fp32; everything
else in ``act_dtype``. Two modes:

* ``act_dtype=torch.bfloat16`` (serving): BF16 activations between operations; each linear is the math of
  :func:`reference_impl.dense.w4a16_linear` accumulated in fp64 and rounded to BF16 once, after any
  tensor-parallel reduction (also done in fp64). With fp64 accumulation the BF16 result does not depend on
  summation order in practice, so the output is independent of batch composition and of the TP split.
* ``act_dtype=torch.float64`` (exact): no BF16 rounding at all; used to compare with ``transformers``.

Weights are sharded for tensor / expert parallelism by :func:`shard_weights` (see ``Layout``); the
collectives come from a ``Comm`` object so the model itself stays single-process code.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .checkpoint import Checkpoint, CheckpointError, QuantConfig, TensorSpec, check_tensors, linear_specs
from .moe import ExpertWeights, fused_moe_w4a16
from .nvfp4 import BLOCK_SIZE, dequantize
from .routing import softmax_topk

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3MoeForCausalLM": "qwen3_moe"}


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

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise CheckpointError(f"config.json: architectures {archs} not supported (supported: {sorted(ARCHITECTURES)})")
        try:
            heads = cfg["num_attention_heads"]
            common = dict(
                arch=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                num_layers=cfg["num_hidden_layers"], num_heads=heads,
                num_kv_heads=cfg.get("num_key_value_heads", heads),
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                intermediate_size=cfg.get("intermediate_size", 0),
                rope_theta=float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                eos_token_id=cfg.get("eos_token_id"),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 256)),
            )
            if arch == "qwen3_moe":
                if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
                    raise CheckpointError("config.json: only all-MoE Qwen3-MoE models (decoder_sparse_step 1) are supported")
                common.update(num_experts=cfg.get("num_experts") or cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                              moe_intermediate_size=cfg["moe_intermediate_size"],
                              norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))
        except KeyError as exc:
            raise CheckpointError(f"config.json: missing key {exc.args[0]!r}") from exc
        return cls(**common, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))


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


def _rope_magnitude(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``|x cos| + |rotate_half(x) sin|``: the two rounded products of the rotary embedding."""
    x, h = x.double(), x.shape[-1] // 2
    rotated = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return (x * cos.double()).abs() + (rotated * sin.double()).abs()


def _split(total: int, parts: int, rank: int, what: str, unit: int = 1) -> slice:
    if total % parts or (total // parts) % unit:
        raise CheckpointError(f"{what} = {total} cannot be split into {parts} parts of a multiple of {unit}")
    size = total // parts
    return slice(rank * size, (rank + 1) * size)


def _linear_names(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(prefix, out_features, in_features) of every linear that may be quantized."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        out += [(f"{p}.self_attn.q_proj", q, h), (f"{p}.self_attn.k_proj", kv, h),
                (f"{p}.self_attn.v_proj", kv, h), (f"{p}.self_attn.o_proj", h, q)]
        if cfg.arch == "llama":
            out += [(f"{p}.mlp.{n}_proj", cfg.intermediate_size, h) for n in ("gate", "up")]
            out.append((f"{p}.mlp.down_proj", h, cfg.intermediate_size))
        else:
            for e in range(cfg.num_experts):
                pe = f"{p}.mlp.experts.{e}"
                out += [(f"{pe}.gate_proj", cfg.moe_intermediate_size, h), (f"{pe}.up_proj", cfg.moe_intermediate_size, h),
                        (f"{pe}.down_proj", h, cfg.moe_intermediate_size)]
    return out


def checkpoint_specs(cfg: ModelConfig, quant: QuantConfig) -> list[TensorSpec]:
    """Every tensor a checkpoint of ``cfg`` must hold, with dtype and shape."""
    bf16, h = torch.bfloat16, cfg.hidden_size
    specs = [TensorSpec("model.embed_tokens.weight", bf16, (cfg.vocab_size, h)),
             TensorSpec("model.norm.weight", bf16, (h,)),
             TensorSpec("lm_head.weight", bf16, (cfg.vocab_size, h), required=not cfg.tie_word_embeddings)]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        specs += [TensorSpec(f"{p}.input_layernorm.weight", bf16, (h,)),
                  TensorSpec(f"{p}.post_attention_layernorm.weight", bf16, (h,))]
        if cfg.arch == "qwen3_moe":
            specs += [TensorSpec(f"{p}.self_attn.q_norm.weight", bf16, (cfg.head_dim,)),
                      TensorSpec(f"{p}.self_attn.k_norm.weight", bf16, (cfg.head_dim,)),
                      TensorSpec(f"{p}.mlp.gate.weight", bf16, (cfg.num_experts, h))]
    for prefix, n, k in _linear_names(cfg):
        specs += linear_specs(prefix, n, k, quant, awq_applies=".experts." not in prefix)
    return specs


def validate_checkpoint(ckpt: Checkpoint) -> ModelConfig:
    """The model config of ``ckpt`` after checking every tensor it needs (clear error otherwise)."""
    cfg = ModelConfig.from_hf(ckpt.hf_config)
    _check_servable(cfg, ckpt)
    check_tensors(ckpt.tensors, checkpoint_specs(cfg, ckpt.quant), source=ckpt.path)
    return cfg


def _check_servable(cfg: ModelConfig, ckpt: Checkpoint) -> None:
    """What a real export may hold that this W4A16 reference cannot serve faithfully: a clear error each."""
    if ckpt.quant.kv_cache_quant_algo is not None:
        raise CheckpointError(
            f"{ckpt.path}: kv_cache_quant_algo {ckpt.quant.kv_cache_quant_algo!r}: the checkpoint asks engines for a "
            f"quantized KV cache (k_scale / v_scale); the reference serves W4A16 NVFP4 with a BF16 KV cache, so its golden "
            f"outputs and bounds would not hold: export without KV-cache quantization")
    embed = ckpt.tensors.get("model.embed_tokens.weight")
    if embed is not None and embed.dtype == torch.float16:
        raise CheckpointError(
            f"{ckpt.path}: the unquantized tensors are float16 (model.embed_tokens.weight); W4A16 NVFP4 means BF16 "
            f"activations and BF16 unquantized weights: quantize and export the model in bfloat16 "
            f"(model.to(torch.bfloat16) before modelopt.torch.quantization.quantize)")
    for name, t in ckpt.tensors.items():
        # engines apply pre_quant_scale in dense linears only (SGLang 0.5.23's NVFP4 MoE method has none), and so
        # does the reference: an expert scale other than ones would be silently dropped by both
        if ".experts." in name and name.endswith(".pre_quant_scale") and not bool((t.float() == 1).all()):
            raise CheckpointError(
                f"{ckpt.path}: tensor {name!r} is an AWQ pre_quant_scale of a MoE expert with values other than 1; "
                f"neither engines' MoE paths nor the reference apply it, so no engine can serve this checkpoint as "
                f"written")


def _slice_linear(t: dict, prefix: str, rows: slice | None, cols: slice | None) -> dict[str, torch.Tensor]:
    """The [rows, cols] block of linear ``prefix`` (cols in unpacked K units, multiples of 16)."""
    w = t[f"{prefix}.weight"]
    out: dict[str, torch.Tensor] = {}
    if w.dtype != torch.uint8:  # excluded (unquantized) linear
        out["weight"] = w[rows or slice(None)][:, cols or slice(None)]
        return out
    packed_cols = slice(cols.start // 2, cols.stop // 2) if cols else slice(None)
    scale_cols = slice(cols.start // BLOCK_SIZE, cols.stop // BLOCK_SIZE) if cols else slice(None)
    out["weight"] = w[rows or slice(None)][:, packed_cols]
    out["weight_scale"] = t[f"{prefix}.weight_scale"][rows or slice(None)][:, scale_cols]
    out["weight_scale_2"] = t[f"{prefix}.weight_scale_2"].float().reshape(())
    pqs = t.get(f"{prefix}.pre_quant_scale") if ".experts." not in prefix else None  # MoE: no AWQ (as engines)
    if pqs is not None:
        out["pre_quant_scale"] = pqs[cols or slice(None)]
    return {k: v.contiguous().clone() for k, v in out.items()}


def shard_weights(cfg: ModelConfig, tensors: dict[str, torch.Tensor], layout: Layout = Layout(),
                  device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Flat dict ``<linear>.<field>`` / ``<param>`` of this rank's slice, on ``device``."""
    out: dict[str, torch.Tensor] = {}
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        out[name] = tensors[name]
    out["lm_head.weight"] = tensors["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    hd, a = cfg.head_dim, layout
    q_rows = _split(cfg.num_heads, a.attn_size, a.attn_rank, "attention heads")
    if cfg.num_kv_heads < a.attn_size and a.attn_size % cfg.num_kv_heads == 0:
        # more ranks than KV heads: each KV head is replicated on attn_size / num_kv_heads ranks
        kv = a.attn_rank // (a.attn_size // cfg.num_kv_heads)
        kv_rows = slice(kv, kv + 1)
    else:
        kv_rows = _split(cfg.num_kv_heads, a.attn_size, a.attn_rank, "key/value heads")
    q_rows, kv_rows = slice(q_rows.start * hd, q_rows.stop * hd), slice(kv_rows.start * hd, kv_rows.stop * hd)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                  "self_attn.k_norm.weight", "mlp.gate.weight"):
            if f"{p}.{n}" in tensors:
                out[f"{p}.{n}"] = tensors[f"{p}.{n}"]
        parts = {"self_attn.q_proj": (q_rows, None), "self_attn.k_proj": (kv_rows, None),
                 "self_attn.v_proj": (kv_rows, None), "self_attn.o_proj": (None, q_rows)}
        if cfg.arch == "llama":
            mlp = _split(cfg.intermediate_size, a.attn_size, a.attn_rank, "intermediate_size", BLOCK_SIZE)
            parts.update({"mlp.gate_proj": (mlp, None), "mlp.up_proj": (mlp, None), "mlp.down_proj": (None, mlp)})
        else:
            experts = _split(cfg.num_experts, a.ep_size, a.ep_rank, "num_experts")
            inter = _split(cfg.moe_intermediate_size, a.moe_tp_size, a.moe_tp_rank, "moe_intermediate_size", BLOCK_SIZE)
            for e in range(experts.start, experts.stop):
                parts.update({f"mlp.experts.{e}.gate_proj": (inter, None), f"mlp.experts.{e}.up_proj": (inter, None),
                              f"mlp.experts.{e}.down_proj": (None, inter)})
        for lin, (rows, cols) in parts.items():
            for field_name, v in _slice_linear(tensors, f"{p}.{lin}", rows, cols).items():
                out[f"{p}.{lin}.{field_name}"] = v
    return {k: v.to(device) for k, v in out.items()}


def _stack_experts(w: dict, p: str, local: list[int], num_experts: int) -> ExpertWeights:
    def field_of(e, proj, f):
        return w[f"{p}.experts.{e}.{proj}.{f}"]

    w13 = torch.stack([torch.cat([field_of(e, "gate_proj", "weight"), field_of(e, "up_proj", "weight")]) for e in local])
    s13 = torch.stack([torch.cat([field_of(e, "gate_proj", "weight_scale"), field_of(e, "up_proj", "weight_scale")])
                       for e in local])
    ws13 = torch.stack([torch.stack([field_of(e, "gate_proj", "weight_scale_2"), field_of(e, "up_proj", "weight_scale_2")])
                        for e in local])
    w2 = torch.stack([field_of(e, "down_proj", "weight") for e in local])
    s2 = torch.stack([field_of(e, "down_proj", "weight_scale") for e in local])
    ws2 = torch.stack([field_of(e, "down_proj", "weight_scale_2") for e in local])
    ep_rank = local[0] // len(local)  # contiguous equal ranges (shard_weights)
    return ExpertWeights(w13, s13, ws13, w2, s2, ws2, activation="swiglu", ep_rank=ep_rank)


class StoreObserver:
    """Sees every intermediate the model stores in the activation dtype (see ``TinyModel._store``); returns
    the value to continue with. :class:`reference_impl.golden.RoundingAnalysis` is the one in use."""

    def __call__(self, kind: str, value: torch.Tensor, magnitude: torch.Tensor | None, n: int,
                 reduced: bool) -> torch.Tensor:
        raise NotImplementedError


class Comm:
    """Single-process collectives (identity). The server subclasses this with torch.distributed."""

    def attn_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def moe_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def moe_gather(self, x: torch.Tensor) -> tuple[torch.Tensor, slice]:
        """All data-parallel groups' tokens and the slice that is this rank's own."""
        return x, slice(0, x.shape[0])


class TinyModel:
    """Forward pass over a list of token sequences; returns each sequence's last-position logits (fp64)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], comm: Comm | None = None,
                 act_dtype: torch.dtype = torch.bfloat16, observer: "StoreObserver | None" = None):
        self.cfg, self.w, self.comm, self.act = cfg, weights, comm or Comm(), act_dtype
        self.observer = observer
        self.forced_routes: dict[tuple[int, int], tuple[int, int]] = {}  # (layer, row) -> (expert out, expert in)
        self._decoded: dict[str, torch.Tensor] | None = None
        self._experts: dict[str, ExpertWeights] | None = None
        self.local_experts = sorted({int(k.split(".")[5]) for k in weights if ".mlp.experts." in k})

    # ------------------------------------------------------------------ building blocks
    def prepare(self) -> None:
        """Decode every NVFP4 linear's ``e2m1 * e4m3`` once (exact in fp64), as an engine prepares weights
        after loading; call again after the weights change. ``weight_scale_2`` stays a separate factor."""
        self._decoded = {}
        self._experts = {f"model.layers.{i}.mlp": _stack_experts(self.w, f"model.layers.{i}.mlp", self.local_experts,
                                                                 self.cfg.num_experts)
                         for i in range(self.cfg.num_layers)} if self.local_experts else {}
        for name, t in self.w.items():
            if name.endswith(".weight_scale") and not name.endswith("_2"):
                prefix = name[: -len(".weight_scale")]
                # weight_scale_2 = 1 keeps the product exact: e2m1 * e4m3 is representable in fp32 and fp64
                self._decoded[prefix] = dequantize(self.w[f"{prefix}.weight"], t, 1.0, torch.float64)

    def _store(self, value: torch.Tensor, kind: str, magnitude=None, n: int = 0, reduced: bool = False) -> torch.Tensor:
        """``value`` kept in the activation dtype: where a serving engine stores an intermediate in BF16 (one
        rounding). ``kind``, ``magnitude`` (a callable giving a tensor, or for linears the operands
        ``(x * pre_quant_scale, W * weight_scale_2)``), ``n`` (reduction length) and ``reduced`` (a
        tensor-parallel reduction output) describe the rounding for the error analysis of
        :mod:`reference_impl.golden`; they are only evaluated when an observer is attached."""
        out = value.to(self.act)
        if self.observer is not None:
            with torch.no_grad():
                info = magnitude() if magnitude is not None else None
            out = self.observer(kind, out, info, n, reduced)
        return out

    def _proj(self, x: torch.Tensor, prefix: str, reduce=None) -> torch.Tensor:
        """A linear stored in the activation dtype: column-parallel (``reduce`` None) or row-parallel."""
        y = self.linear(x, prefix)
        y = reduce(y) if reduce is not None else y
        return self._store(y, "linear_awq" if f"{prefix}.pre_quant_scale" in self.w else "linear",
                           lambda: self.linear_operands(x, prefix), x.shape[-1], reduce is not None)

    def linear_operands(self, x: torch.Tensor, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x * pre_quant_scale, dequant(W) * weight_scale_2)`` in fp64, detached: what :meth:`linear`
        multiplies (for the error analysis)."""
        xd = x.detach().double()
        pqs = self.w.get(f"{prefix}.pre_quant_scale")
        if pqs is not None:
            xd = xd * pqs.double()
        return xd, self._decoded[prefix] * self.w[f"{prefix}.weight_scale_2"].double()

    def linear(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        """This rank's partial ``((x * pre_quant_scale) @ dequant(W)^T) * weight_scale_2`` in fp64, the
        operation order of :func:`reference_impl.dense.w4a16_linear` with ``accum_dtype=float64`` (the
        self-tests check they agree bit for bit); the caller reduces and rounds."""
        if self._decoded is None:
            self.prepare()
        xd = x.double()
        pqs = self.w.get(f"{prefix}.pre_quant_scale")
        if pqs is not None:
            xd = xd * pqs.double()
        return (xd @ self._decoded[prefix].T) * self.w[f"{prefix}.weight_scale_2"].double()

    def rms_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """fp32 statistics, as transformers. In serving mode the mean of squares is summed in fp64 and then
        rounded to fp32: an fp32 row reduction's summation order may depend on how many rows there are
        (GPU reduction kernels split rows differently), which would make outputs depend on the batch."""
        x32 = x.float()
        if self.act == torch.bfloat16:
            ms = x.double().pow(2).mean(-1, keepdim=True).float()
        else:
            ms = x32.pow(2).mean(-1, keepdim=True)
        y = x32 * torch.rsqrt(ms + self.cfg.rms_norm_eps)
        return self._store(self.w[name].to(self.act) * self._store(y, "round"), "round")

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.cfg.head_dim
        inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return self._store(emb.cos(), "round"), self._store(emb.sin(), "round")

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)

    def attention(self, x: torch.Tensor, p: str, lengths: list[int]) -> torch.Tensor:
        """Causal self-attention of packed sequences ``x [sum(lengths), H]`` (each from position 0)."""
        cfg, act = self.cfg, self.act
        t, hd = x.shape[0], cfg.head_dim
        q = self._heads(self._proj(x, f"{p}.q_proj"), hd)
        k = self._heads(self._proj(x, f"{p}.k_proj"), hd)
        v = self._heads(self._proj(x, f"{p}.v_proj"), hd)
        if f"{p}.q_norm.weight" in self.w:
            q, k = self.rms_norm(q, f"{p}.q_norm.weight"), self.rms_norm(k, f"{p}.k_norm.weight")
        outs = []
        for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
            outs.append(self._attend(qs, ks, vs))
        o = torch.cat(outs) if outs else q.new_zeros(0, q.shape[1] * hd)
        return self._proj(o, f"{p}.o_proj", self.comm.attn_all_reduce)

    def _heads(self, y: torch.Tensor, hd: int) -> torch.Tensor:
        return y.view(y.shape[0], y.shape[-1] // hd, hd)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t, hd, act = q.shape[0], q.shape[-1], self.act
        cos, sin = self.rope(torch.arange(t, device=q.device))
        cos, sin = cos[:, None, :], sin[:, None, :]
        q = self._store(q * cos + self._rotate_half(q) * sin, "sum", lambda: _rope_magnitude(q, cos, sin))
        k = self._store(k * cos + self._rotate_half(k) * sin, "sum", lambda: _rope_magnitude(k, cos, sin))
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = self._store(torch.einsum("qhd,khd->hqk", q.double(), k.double()) * hd ** -0.5, "dot",
                             lambda: torch.einsum("qhd,khd->hqk", q.double().abs(), k.double().abs()) * hd ** -0.5, hd)
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = self._store(F.softmax(scores, dim=-1, dtype=torch.float32), "round")
        o = torch.einsum("hqk,khd->qhd", probs.double(), v.double())
        return self._store(o, "dot", lambda: torch.einsum("hqk,khd->qhd", probs.double().abs(), v.double().abs()),
                           t).reshape(t, -1)

    def dense_mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        g = self._proj(x, f"{p}.gate_proj")
        u = self._proj(x, f"{p}.up_proj")
        h = self._store(F.silu(g.double()) * u.double(), "act")
        return self._proj(h, f"{p}.down_proj", self.comm.attn_all_reduce)

    def route(self, x: torch.Tensor, p: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids and weights: router logits in the activation dtype, then
        :func:`reference_impl.routing.softmax_topk` (fp32 softmax, renormalised when configured)."""
        gate = self.w[f"{p}.gate.weight"].double()
        logits = self._store(x.double() @ gate.T, "router", lambda: x.double().abs() @ gate.abs().T, x.shape[-1])
        if logits.shape[0] == 0:
            empty = torch.zeros(0, self.cfg.top_k, device=x.device)
            return empty.long(), empty.to(self.act)
        ids, weights = softmax_topk(logits, self.cfg.top_k, renormalize=self.cfg.norm_topk_prob)
        forced = {row: swap for (layer, row), swap in self.forced_routes.items() if f"layers.{layer}." in p + "."}
        if forced:  # the other side of a routing near-tie (reference_impl/golden.py): swap one expert
            ids = ids.clone()
            for row, (drop, add) in forced.items():
                ids[row][ids[row] == drop] = add
            weights = torch.softmax(logits.float(), dim=-1).gather(1, ids.long())
            if self.cfg.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids.long(), self._store(weights, "round")

    def moe(self, x: torch.Tensor, p: str) -> torch.Tensor:
        """Experts owned by this rank contribute; tokens routed elsewhere contribute nothing here. Serving
        mode runs :func:`reference_impl.moe.fused_moe_w4a16` (fp64 accumulation, BF16 intermediate as the
        kernels store it); the exact mode runs the same math in fp64 without the intermediate rounding."""
        xs, mine = self.comm.moe_gather(x)
        ids, weights = self.route(xs, p)
        if self.act == torch.bfloat16:
            if self._experts is None:
                self.prepare()
            out = fused_moe_w4a16(xs, ids, weights, self._experts[p], accum_dtype=torch.float64,
                                  round_intermediate=True, out_dtype=torch.float64)
            return self.comm.moe_all_reduce(out)[mine].to(self.act)
        out, magnitude = self._moe_exact(xs, ids, weights, p)
        return self._store(self.comm.moe_all_reduce(out)[mine], "combine", lambda: magnitude[:, mine], self.cfg.top_k,
                           reduced=True)

    def _moe_exact(self, xs: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   p: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact experts (fp64; ``_store`` keeps fp64 here) and, with an observer, the magnitudes of the
        weighted combination: ``sum_k |w_k y_k|`` and ``sum_k |w_k| A_k`` (``A_k`` the down projection's
        ``|h| @ |W|^T``, which bounds any rank's partial of ``y_k``)."""
        out = torch.zeros(xs.shape[0], xs.shape[1], dtype=torch.float64, device=xs.device)
        magnitude = torch.zeros(2, *out.shape, dtype=torch.float64, device=xs.device)
        for e in self.local_experts:
            tok, slot = torch.where(ids == e)
            if tok.numel() == 0:
                continue
            xe = xs[tok]
            g = self._proj(xe, f"{p}.experts.{e}.gate_proj")
            u = self._proj(xe, f"{p}.experts.{e}.up_proj")
            h = self._store(F.silu(g) * u, "act")
            y = self.linear(h, f"{p}.experts.{e}.down_proj")  # fp64 partial over the moe-tp slice
            y = self._store(y, "linear", lambda: self.linear_operands(h, f"{p}.experts.{e}.down_proj"), h.shape[-1])
            contribution = y * weights[tok, slot].double()[:, None]
            out = out.index_add(0, tok, contribution)
            if self.observer is not None:
                with torch.no_grad():
                    x_abs, w_abs = (t.abs() for t in self.linear_operands(h, f"{p}.experts.{e}.down_proj"))
                    weight = weights[tok, slot].detach().double().abs()[:, None]
                    magnitude[0].index_add_(0, tok, contribution.detach().abs())
                    magnitude[1].index_add_(0, tok, (x_abs @ w_abs.T) * weight)
        return out, magnitude

    # ------------------------------------------------------------------ forward
    def hidden_states(self, seqs: list[torch.Tensor]) -> torch.Tensor:
        """Final-norm hidden states ``[sum(T_i), H]`` of packed sequences (no KV cache: every prefix is
        recomputed, so a sequence's result does not depend on what else is in the batch)."""
        lengths = [int(s.numel()) for s in seqs]
        emb = self.w["model.embed_tokens.weight"]
        ids = torch.cat(seqs) if seqs else torch.zeros(0, dtype=torch.long, device=emb.device)
        x = emb.to(self.act)[ids.to(emb.device)]
        for i in range(self.cfg.num_layers):
            p = f"model.layers.{i}"
            x = self._store(x + self.attention(self.rms_norm(x, f"{p}.input_layernorm.weight"), f"{p}.self_attn", lengths),
                            "round")
            h = self.rms_norm(x, f"{p}.post_attention_layernorm.weight")
            x = self._store(x + (self.dense_mlp(h, f"{p}.mlp") if self.cfg.arch == "llama" else self.moe(h, f"{p}.mlp")),
                            "round")
        return self.rms_norm(x, "model.norm.weight")

    def logits(self, seqs: list[torch.Tensor]) -> torch.Tensor:
        """Logits ``[sum(T_i), V]`` (fp64) of packed sequences. An engine's LM head writes BF16 logits: with an
        observer attached they are a store of their own (the model itself returns them unrounded)."""
        h = self.hidden_states(seqs).double()
        w = self.w["lm_head.weight"].double()
        if self.observer is None:
            return h @ w.T
        return self.observer("dot", h @ w.T, h.detach().abs() @ w.abs().T, h.shape[-1], False)

    def last_logits(self, seqs: list[torch.Tensor]) -> torch.Tensor:
        """Logits ``[len(seqs), V]`` (fp64) at each sequence's last position."""
        h = self.hidden_states(seqs)
        ends = torch.tensor([int(s.numel()) for s in seqs], dtype=torch.long, device=h.device).cumsum(0) - 1
        return h[ends].double() @ self.w["lm_head.weight"].double().T
