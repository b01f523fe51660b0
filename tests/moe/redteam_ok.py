"""Correct-but-different fused-MoE backends (red team, tests/moe/redteam.py): other expert orders, routing
matrices, precisions and a grouped GEMM. The suite must accept every one."""
from __future__ import annotations

import torch

from .redteam import DenseMaskScatter, MoERedTeam


class ReverseExpertOrder(MoERedTeam):
    name = "rt-moe-ok-reverse"

    def expert_order(self, experts):
        return experts[::-1]


class ShuffledExpertOrder(MoERedTeam):
    name = "rt-moe-ok-shuffled"

    def expert_order(self, experts):
        g = torch.Generator().manual_seed(len(experts))
        return [experts[i] for i in torch.randperm(len(experts), generator=g).tolist()]


class DenseMaskScatterAdd(DenseMaskScatter):
    """HF-style dense routing matrix with scatter_add: duplicates summed."""
    name = "rt-moe-ok-dense-mask-scatter-add"
    accumulate = True


class NegOneMaskedToExpert0(MoERedTeam):
    """-1 slots redirected to expert 0 with a weight forced to 0 by torch.where (never multiplied)."""
    name = "rt-moe-ok-neg1-masked"

    def local_ids(self, p, ids):
        return super().local_ids(p, ids.clamp(min=0))

    def slot_weights(self, p, ids, w):
        return torch.where(ids < 0, torch.zeros_like(w), w)


class Fp32Intermediate(MoERedTeam):
    name = "rt-moe-ok-fp32-intermediate"

    def intermediate(self, h):
        return h


class Fp64Moe(MoERedTeam):
    name = "rt-moe-ok-fp64"

    def prepare_moe(self, ex, device):
        p = super().prepare_moe(ex, device)
        for f in ("w13", "w2", "s_gate", "s_up", "s_down"):
            setattr(p, f, getattr(p, f).double())
        return p

    def hidden(self, x):
        return x.double()

    def intermediate(self, h):
        return h

    def new_output(self, p, x):
        return torch.zeros(x.shape, dtype=torch.float64)

    def run_moe(self, p, x, topk_ids, topk_weights):
        return super().run_moe(p, x, topk_ids, topk_weights.double())


class Bf16PerSlotCombine(MoERedTeam):
    """Each weight * expert output rounded to BF16 (the kernel's finalize), summed in fp32."""
    name = "rt-moe-ok-bf16-per-slot"

    def combine(self, out, tokens, contrib):
        out.index_add_(0, tokens, contrib.bfloat16().float())


class GroupedGemmPadded(MoERedTeam):
    """Tokens sorted by expert and padded to tiles of 8 rows; one batched GEMM per stage over all local experts."""
    name = "rt-moe-ok-grouped"

    def run_moe(self, p, x, topk_ids, topk_weights):
        xc, w = x.cpu().float(), topk_weights.cpu().float()
        local, owned = self.local_ids(p, topk_ids.cpu())
        e_loc = p.ex.num_local_experts
        counts = [int((owned & (local == e)).sum()) for e in range(e_loc)]
        cap = max(8, -(-max(counts + [1]) // 8) * 8)
        xs = torch.zeros(e_loc, cap, xc.shape[1])
        tok_idx = torch.full((e_loc, cap), -1, dtype=torch.long)
        wts = torch.zeros(e_loc, cap)
        for e in range(e_loc):
            tok, slot = torch.nonzero(owned & (local == e), as_tuple=True)
            xs[e, : tok.numel()] = xc[tok]
            tok_idx[e, : tok.numel()] = tok
            wts[e, : tok.numel()] = w[tok, slot]
        gu = torch.bmm(xs, p.w13.transpose(1, 2))
        if p.ex.activation == "relu2":
            h = self.activation(p, gu * p.s_gate.view(-1, 1, 1), None)
        else:
            half = gu.shape[-1] // 2
            h = self.activation(p, gu[..., :half] * p.s_gate.view(-1, 1, 1), gu[..., half:] * p.s_up.view(-1, 1, 1))
        o = torch.bmm(h.bfloat16().float(), p.w2.transpose(1, 2)) * p.s_down.view(-1, 1, 1)
        out = torch.zeros(xc.shape)
        valid = tok_idx >= 0
        out.index_add_(0, tok_idx[valid], (wts.unsqueeze(-1) * o)[valid])
        return out.bfloat16().to(x.device)
class GeluErf(MoERedTeam):
    """geglu with the exact (erf) GELU instead of the tanh approximation: |gelu_erf - gelu_tanh| < 5e-4, below
    the BF16 resolution of the intermediate, so no check can (or should) tell them apart."""
    name = "rt-moe-geglu-erf"

    def activation(self, p, g, u):
        if p.ex.activation == "geglu":
            return torch.nn.functional.gelu(g) * u
        return super().activation(p, g, u)
class Bf16ExpertOutputBeforeWeight(MoERedTeam):
    """Each weight * expert output rounded to BF16 and summed in BF16 (fused-finalize atomics): allowed by the
    bound (reference_impl/bounds/moe.py, item 5)."""
    name = "rt-moe-bf16-atomics"

    def combine(self, out, tokens, contrib):
        for i, t in enumerate(tokens.tolist()):
            out[t] = (out[t].bfloat16().float() + contrib[i].bfloat16().float()).bfloat16().float()


CORRECT = [
    MoERedTeam, ReverseExpertOrder, ShuffledExpertOrder, DenseMaskScatterAdd, NegOneMaskedToExpert0,
    Fp32Intermediate, Fp64Moe, Bf16PerSlotCombine, GroupedGemmPadded, GeluErf, Bf16ExpertOutputBeforeWeight,
]
