"""The reference server's model: the architectures of :mod:`reference_impl.model.architectures` written by hand with
the reference W4A16 math in every linear, sharded for tensor / expert parallelism (docs/contracts.md section 6).

Why hand-written when transformers has these classes (the golden truth, :mod:`reference_impl.truth`, runs
transformers' own classes): a serving engine shards attention heads, MLP columns and experts over ranks and
reduces partial sums; transformers' classes have no such sharding of NVFP4 weights with fp64 accumulation,
and outputs must not depend on the batch or on the TP split (see serving mode below). Its exact mode is also
the independent path the truth is checked against (tests/reference/test_architectures.py).

Precision conventions follow the Hugging Face implementations: RMSNorm statistics, rotary angles, attention
softmax, the MoE router softmax and DeepSeek-V3's router GEMM and sigmoid are computed in fp32; everything else
in ``act_dtype``. Two modes:

* ``act_dtype=torch.bfloat16`` (serving): BF16 activations between operations; each linear is the math of
  :func:`reference_impl.dense.w4a16_linear` accumulated in fp64 and rounded to BF16 once, after any
  tensor-parallel reduction (also done in fp64). With fp64 accumulation the BF16 result does not depend on
  summation order in practice, so the output is independent of batch composition and of the TP split.
* ``act_dtype=torch.float64`` (exact): no BF16 rounding at all.

Weights are sharded by :func:`reference_impl.model.architectures.shard_weights`; the collectives come from a
``Comm`` object so the model itself stays single-process code. The rotary tables and scales are in
:mod:`reference_impl.model.rope`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from reference_impl.model.architectures import (ARCHITECTURES, Layout, ModelConfig, checkpoint_specs, rope_parameters,  # noqa: F401
                            shard_weights, validate_checkpoint)
from reference_impl.model.checkpoint import CheckpointError  # noqa: F401  (re-exported: callers catch it from here)
from reference_impl.moe import ExpertWeights, fused_moe_w4a16
from reference_impl.format.nvfp4 import dequantize
from reference_impl.model.rope import _rope_magnitude, mla_softmax_scale, rope_tables  # noqa: F401 - re-exported: the names this module offered
from reference_impl.moe.routing import sigmoid_topk_with_bias, softmax_topk


#: Largest fp64 size of a model's decoded experts that :class:`TinyModel` keeps between forwards.
EXPERT_CACHE_BYTES = 1 << 30


def _stack_experts(w: dict, cfg: ModelConfig, layer: int, local: list[int]) -> ExpertWeights:
    def f(e, which, name):
        return w[f"{cfg.expert(layer, e, which)}.{name}"]

    w13 = torch.stack([torch.cat([f(e, 0, "weight"), f(e, 1, "weight")]) for e in local])
    s13 = torch.stack([torch.cat([f(e, 0, "weight_scale"), f(e, 1, "weight_scale")]) for e in local])
    ws13 = torch.stack([torch.stack([f(e, 0, "weight_scale_2"), f(e, 1, "weight_scale_2")]) for e in local])
    w2 = torch.stack([f(e, 2, "weight") for e in local])
    s2 = torch.stack([f(e, 2, "weight_scale") for e in local])
    ws2 = torch.stack([f(e, 2, "weight_scale_2") for e in local])
    ep_rank = local[0] // len(local)  # contiguous equal ranges (shard_weights)
    return ExpertWeights(w13, s13, ws13, w2, s2, ws2, activation="swiglu", ep_rank=ep_rank)


class StoreObserver:
    """Sees every intermediate the model stores in the activation dtype (see ``TinyModel._store``); returns
    the value to continue with. :class:`reference_impl.truth.stores.RoundingAnalysis` is one."""

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
        self._decoded: dict[str, torch.Tensor] | None = None
        self._experts: dict[int, ExpertWeights] | None = None
        self._expert_caches: dict[int, dict] = {}
        self.local_experts = sorted({int(k.split(".experts.")[1].split(".")[0]) for k in weights if ".experts." in k})

    # ------------------------------------------------------------------ building blocks
    def prepare(self) -> None:
        """Decode every NVFP4 linear's ``e2m1 * e4m3`` once (exact in fp64), as an engine prepares weights
        after loading; call again after the weights change. ``weight_scale_2`` stays a separate factor."""
        self._decoded = {}
        self._experts = {i: _stack_experts(self.w, self.cfg, i, self.local_experts)
                         for i in self.cfg.moe_layers} if self.local_experts else {}
        # decoded experts kept across forwards (fused_moe_w4a16's expert_cache) while their fp64 copies are
        # small; a real MoE checkpoint's (16x its packed bytes) are decoded at each use instead
        fp64_bytes = sum(8 * 2 * (e.w13.numel() + e.w2.numel()) for e in self._experts.values())
        self._expert_caches = {i: {} for i in self._experts} if fp64_bytes <= EXPERT_CACHE_BYTES else {}
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
        :mod:`reference_impl.truth.golden`; they are only evaluated when an observer is attached."""
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
        return self._store(y, self.linear_kind(prefix), lambda: self.linear_operands(x, prefix), x.shape[-1],
                           reduce is not None)

    def linear_kind(self, prefix: str) -> str:
        if f"{prefix}.weight_scale" not in self.w:
            return "linear_exact"  # excluded from quantization: BF16 weights, exact in a BF16 GEMM
        return "linear_awq" if f"{prefix}.pre_quant_scale" in self.w else "linear"

    def _weight(self, prefix: str) -> torch.Tensor:
        if self._decoded is None:
            self.prepare()
        dec = self._decoded.get(prefix)
        return self.w[f"{prefix}.weight"].double() if dec is None else dec

    def _scale2(self, prefix: str) -> torch.Tensor | float:
        ws2 = self.w.get(f"{prefix}.weight_scale_2")
        return 1.0 if ws2 is None else ws2.double()

    def linear_operands(self, x: torch.Tensor, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x * pre_quant_scale, dequant(W) * weight_scale_2)`` in fp64, detached: what :meth:`linear`
        multiplies (for the error analysis)."""
        xd = x.detach().double()
        pqs = self.w.get(f"{prefix}.pre_quant_scale")
        if pqs is not None:
            xd = xd * pqs.double()
        return xd, self._weight(prefix) * self._scale2(prefix)

    def linear(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        """This rank's partial ``((x * pre_quant_scale) @ dequant(W)^T) * weight_scale_2`` in fp64, the
        operation order of :func:`reference_impl.dense.w4a16_linear` with ``accum_dtype=float64`` (the
        self-tests check they agree bit for bit); the caller reduces and rounds."""
        xd = x.double()
        pqs = self.w.get(f"{prefix}.pre_quant_scale")
        if pqs is not None:
            xd = xd * pqs.double()
        return (xd @ self._weight(prefix).T) * self._scale2(prefix)

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
        cos, sin = rope_tables(self.cfg, positions)
        return self._store(cos, "round"), self._store(sin, "round")

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
        """The rotary embedding; interleaved pairs (DeepSeek) come out de-interleaved, as transformers writes them
        (q and k alike, so every dot product is the same)."""
        if interleave:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        h = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin

    def _rope_pair(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[t, h, d]`` and k ``[t, hk, d]`` rotated, each a stored sum of two products."""
        il = self.cfg.rope_interleave
        cos, sin = self.rope(torch.arange(q.shape[0], device=q.device))
        cos, sin = cos[:, None, :], sin[:, None, :]
        q = self._store(self._rotate(q, cos, sin, il), "sum", lambda: _rope_magnitude(q, cos, sin, il))
        k = self._store(self._rotate(k, cos, sin, il), "sum", lambda: _rope_magnitude(k, cos, sin, il))
        return q, k

    def attention(self, x: torch.Tensor, p: str, lengths: list[int]) -> torch.Tensor:
        """Causal self-attention of packed sequences ``x [sum(lengths), H]`` (each from position 0)."""
        if self.cfg.is_mla:
            return self.mla_attention(x, p, lengths)
        hd = self.cfg.head_dim
        q = self._heads(self._proj(x, f"{p}.q_proj"), hd)
        k = self._heads(self._proj(x, f"{p}.k_proj"), hd)
        v = self._heads(self._proj(x, f"{p}.v_proj"), hd)
        if self.cfg.qk_norm:
            q, k = self.rms_norm(q, f"{p}.q_norm.weight"), self.rms_norm(k, f"{p}.k_norm.weight")
        outs = []
        for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
            qs, ks = self._rope_pair(qs, ks)
            outs.append(self._attend(qs, ks, vs, hd ** -0.5))
        o = torch.cat(outs) if outs else q.new_zeros(0, q.shape[1] * hd)
        return self._proj(o, f"{p}.o_proj", self.comm.attn_all_reduce)

    def mla_attention(self, x: torch.Tensor, p: str, lengths: list[int]) -> torch.Tensor:
        """DeepSeek-V3's multi-head latent attention (no weight absorption: the latents are expanded)."""
        cfg = self.cfg
        nope, rope, vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        if cfg.q_lora_rank:
            q = self._proj(self.rms_norm(self._proj(x, f"{p}.q_a_proj"), f"{p}.q_a_layernorm.weight"), f"{p}.q_b_proj")
        else:
            q = self._proj(x, f"{p}.q_proj")
        q = self._heads(q, nope + rope)
        latent = self._proj(x, f"{p}.kv_a_proj_with_mqa")
        kv = self._proj(self.rms_norm(latent[:, :cfg.kv_lora_rank], f"{p}.kv_a_layernorm.weight"), f"{p}.kv_b_proj")
        kv = self._heads(kv, nope + vd)
        k_rot = latent[:, None, cfg.kv_lora_rank:]
        outs, start = [], 0
        for n in lengths:
            qs, kvs = q[start:start + n], kv[start:start + n]
            q_rot, kr = self._rope_pair(qs[..., nope:], k_rot[start:start + n])
            qs = torch.cat((qs[..., :nope], q_rot), dim=-1)
            ks = torch.cat((kvs[..., :nope], kr.expand(-1, kvs.shape[1], -1)), dim=-1)
            outs.append(self._attend(qs, ks, kvs[..., nope:], mla_softmax_scale(cfg)))
            start += n
        o = torch.cat(outs) if outs else q.new_zeros(0, q.shape[1] * vd)
        return self._proj(o, f"{p}.o_proj", self.comm.attn_all_reduce)

    def _heads(self, y: torch.Tensor, hd: int) -> torch.Tensor:
        return y.view(y.shape[0], y.shape[-1] // hd, hd)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Rotated ``q [t, h, d]``, ``k [t, hk, d]``, ``v [t, hk, dv]``: softmax attention, ``[t, h * dv]``."""
        t = q.shape[0]
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = self._store(torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale, "dot",
                             lambda: torch.einsum("qhd,khd->hqk", q.double().abs(), k.double().abs()) * scale,
                             q.shape[-1])
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

    def router_logits(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """Router logits, stored: in the activation dtype (Qwen3-MoE, Mixtral) or from an fp32 GEMM (DeepSeek-V3)."""
        gate = self.w[f"{self.cfg.router_prefix(layer)}.weight"]
        if self.cfg.router == "sigmoid_grouped":
            logits = (x.float() @ gate.float().T).to(self.act)
        else:
            logits = x.double() @ gate.double().T
        g = gate.double()
        return self._store(logits, "router", lambda: x.double().abs() @ g.abs().T, x.shape[-1])

    def route(self, x: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids and weights (:mod:`reference_impl.moe.routing`), the weights stored."""
        cfg = self.cfg
        logits = self.router_logits(x, layer)
        if logits.shape[0] == 0:
            empty = torch.zeros(0, cfg.top_k, device=x.device)
            return empty.long(), empty.to(self.act)
        if cfg.router == "sigmoid_grouped":
            bias = self.w[f"{cfg.router_prefix(layer)}.e_score_correction_bias"]
            ids, weights = sigmoid_topk_with_bias(logits, bias, cfg.top_k, cfg.norm_topk_prob, cfg.routed_scaling_factor,
                                                  cfg.n_group, cfg.topk_group)
        else:
            ids, weights = softmax_topk(logits, cfg.top_k, renormalize=cfg.norm_topk_prob)
        return ids.long(), self._store(weights, "round")

    def moe(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """Experts owned by this rank contribute; tokens routed elsewhere contribute nothing here. Serving
        mode runs :func:`reference_impl.moe.fused_moe_w4a16` (fp64 accumulation, BF16 intermediate as the
        kernels store it); the exact mode runs the same math in fp64 without the intermediate rounding.
        Shared experts (DeepSeek-V3) are a tensor-parallel dense MLP added to the routed output (one rounding)."""
        xs, mine = self.comm.moe_gather(x)
        ids, weights = self.route(xs, layer)
        if self.act == torch.bfloat16:
            if self._experts is None:
                self.prepare()
            out = fused_moe_w4a16(xs, ids, weights, self._experts[layer], accum_dtype=torch.float64,
                                  round_intermediate=True, out_dtype=torch.float64,
                                  expert_cache=self._expert_caches.get(layer))
            routed = self.comm.moe_all_reduce(out)[mine].to(self.act)
        else:
            out, magnitude = self._moe_exact(xs, ids, weights, layer)
            routed = self._store(self.comm.moe_all_reduce(out)[mine], "combine", lambda: magnitude[:, mine],
                                 self.cfg.top_k, reduced=True)
        if not self.cfg.n_shared_experts:
            return routed
        return self._store(routed + self.dense_mlp(x, f"{self.cfg.mlp_prefix(layer)}.shared_experts"), "round")

    def _moe_exact(self, xs: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact experts (fp64; ``_store`` keeps fp64 here) and, with an observer, the magnitudes of the
        weighted combination: ``sum_k |w_k y_k|`` and ``sum_k |w_k| A_k`` (``A_k`` the down projection's
        ``|h| @ |W|^T``, which bounds any rank's partial of ``y_k``)."""
        out = torch.zeros(xs.shape[0], xs.shape[1], dtype=torch.float64, device=xs.device)
        magnitude = torch.zeros(2, *out.shape, dtype=torch.float64, device=xs.device)
        for e in self.local_experts:
            tok, slot = torch.where(ids == e)
            if tok.numel() == 0:
                continue
            gate, up, down = (self.cfg.expert(layer, e, w) for w in range(3))
            xe = xs[tok]
            g = self._proj(xe, gate)
            u = self._proj(xe, up)
            h = self._store(F.silu(g) * u, "act")
            y = self.linear(h, down)  # fp64 partial over the moe-tp slice
            y = self._store(y, self.linear_kind(down), lambda: self.linear_operands(h, down), h.shape[-1])
            contribution = y * weights[tok, slot].double()[:, None]
            out = out.index_add(0, tok, contribution)
            if self.observer is not None:
                with torch.no_grad():
                    x_abs, w_abs = (t.abs() for t in self.linear_operands(h, down))
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
            x = self._store(x + (self.moe(h, i) if self.cfg.is_moe(i) else self.dense_mlp(h, f"{p}.mlp")), "round")
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
