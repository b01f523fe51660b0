"""A correct engine whose arithmetic differs from the reference server's: what a GPU engine does.

:class:`Fp32EngineModel` is :class:`reference_impl.model.TinyModel` with the rounding choices of a typical
BF16 inference engine instead of the reference's fp64 accumulation:

* linears: AWQ ``x * pre_quant_scale`` in BF16, the dequantized weight ``W * weight_scale_2`` rounded to
  BF16 (a BF16 GEMM), fp32 accumulation; row-parallel partial sums rounded to BF16 before the all-reduce;
* RMSNorm entirely in fp32 (statistics summed in fp32), rounded once;
* attention: scores, softmax and probabilities @ values in fp32 (flash-attention style), rounded once;
* MoE: the kernel-like fp32 reference (BF16 intermediate) instead of fp64;
* LM head: BF16 logits (as SGLang's logits processor returns them before the fp32 log-softmax).

It is a subclass, so importing it changes nothing; tests/server/mutants.py installs its methods into the
server process (``fp32_engine``) and tests/server/test_server_golden.py runs it in-process.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from reference_impl.model import TinyModel
from reference_impl.moe.grouped import prepare_experts, run_prepared_experts

BF16 = torch.bfloat16


class Fp32EngineModel(TinyModel):
    def linear(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        if self._decoded is None:
            self.prepare()
        xb = x.to(BF16)
        pqs = self.w.get(f"{prefix}.pre_quant_scale")
        if pqs is not None:
            xb = xb * pqs.to(BF16)
        w = (self._decoded[prefix] * self.w[f"{prefix}.weight_scale_2"].double()).to(BF16)
        return (xb.float() @ w.float().T).double()

    def _proj(self, x: torch.Tensor, prefix: str, reduce=None) -> torch.Tensor:
        y = self.linear(x, prefix)
        if reduce is not None:
            y = reduce(y.to(BF16).double())  # each rank's partial rounded to BF16 before the all-reduce
        return y.to(BF16)

    def rms_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return (y * self.w[name].float()).to(BF16)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        t = q.shape[0]
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        probs = F.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, v.float()).to(BF16).reshape(t, -1)

    def dense_mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        g = self._proj(x, f"{p}.gate_proj")
        u = self._proj(x, f"{p}.up_proj")
        h = (F.silu(g.float()) * u.float()).to(BF16)
        return self._proj(h, f"{p}.down_proj", self.comm.attn_all_reduce)

    def moe(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        xs, mine = self.comm.moe_gather(x)
        ids, weights = self.route(xs, layer)
        if self._experts is None:
            self.prepare()
        # as an engine does: every expert decoded once per weight load (prepare() makes new ExpertWeights),
        # then bf16 grouped GEMMs with fp32 accumulation (fused_moe_w4a16's fp32 path, without its per-call decode)
        cache = self.__dict__.setdefault("_fp32_prepared", {})
        hit = cache.get(layer)
        if hit is None or hit[0] is not self._experts[layer]:
            hit = cache[layer] = (self._experts[layer], prepare_experts(self._experts[layer]))
        out = run_prepared_experts(hit[1], xs, ids, weights, out_dtype=torch.bfloat16, round_intermediate=True)
        routed = self.comm.moe_all_reduce(out.double())[mine].to(BF16)
        if not self.cfg.n_shared_experts:
            return routed
        return routed + self.dense_mlp(x, f"{self.cfg.mlp_prefix(layer)}.shared_experts")

    def logits(self, seqs: list[torch.Tensor]) -> torch.Tensor:
        h = self.hidden_states(seqs)
        return (h.float() @ self.w["lm_head.weight"].float().T).to(BF16).double()

    def last_logits(self, seqs: list[torch.Tensor]) -> torch.Tensor:
        h = self.hidden_states(seqs)
        ends = torch.tensor([int(s.numel()) for s in seqs], dtype=torch.long, device=h.device).cumsum(0) - 1
        return (h[ends].float() @ self.w["lm_head.weight"].float().T).to(BF16).double()


#: the methods tests/server/mutants.py installs into TinyModel for the ``fp32_engine`` server
ENGINE_METHODS = ("linear", "_proj", "rms_norm", "_attend", "dense_mlp", "moe", "logits", "last_logits")
