"""Workload-class mutant servers: correct at the scenarios' sizes, wrong in the forwards a KV-cache engine would run
above them (tests/server/test_workload_mutants.py), and one correct-but-different arithmetic that depends on the
forward's size. Registered in tests/server/mutants.py's ``MUTANTS`` (run them through that script).

A KV-cache engine computes a prefill forward over every prompt token (M = their sum), then one decode forward per
step over the running sequences (M = their count). The reference server recomputes whole prefixes at every step;
these mutants misbehave only in the forwards a KV-cache engine would run at those sizes.
"""
from __future__ import annotations

import copy

import torch

from reference_impl.model import TinyModel
from reference_impl.server.engine import Engine

_FORWARD = {"phase": "prefill", "m": 0}  # the forward running now, as a KV-cache engine would size it


def _track_forwards() -> None:
    original = Engine.generate

    def generate(self, requests):
        model, calls = self.model, [0]
        last, full = model.last_logits, model.logits

        def last_logits(seqs):
            phase = "prefill" if calls[0] == 0 else "decode"
            _FORWARD.update(phase=phase, m=sum(len(q) for q in seqs) if phase == "prefill" else len(seqs))
            calls[0] += 1
            other = self._workload_model(phase) if hasattr(self, "_workload_model") else model
            return last(seqs) if other is model else other.last_logits(seqs)

        def logits(seqs):  # prompt logprobs: the prefill's outputs
            _FORWARD.update(phase="prefill", m=sum(len(q) for q in seqs))
            return full(seqs)
        model.last_logits, model.logits = last_logits, logits
        try:
            return original(self, requests)
        finally:
            del model.last_logits, model.logits
    Engine.generate = generate


def _drops_k_block(phase: str, smallest_m: int) -> None:
    """A GEMM tile that drops the last K block: in ``phase`` forwards of at least ``smallest_m`` (tokens or
    sequences), every linear runs without its last 16 input columns."""
    _track_forwards()
    original = TinyModel.linear

    def linear(self, x, prefix):
        if _FORWARD["phase"] == phase and _FORWARD["m"] >= smallest_m:
            x = x.clone()
            x[..., -16:] = 0
        return original(self, x, prefix)
    TinyModel.linear = linear


def large_prefill_drops_k_block() -> dict:
    """A large-M GEMM tile that drops the last K block: prefill forwards above 128 tokens compute every linear
    without its last 16 input columns (right at the scenarios' sizes: their prefills are <= 72 tokens)."""
    _drops_k_block("prefill", 129)
    return {}


def large_decode_batch_drops_k_block() -> dict:
    """The same tile fault in the decode: forwards of 17 or more running sequences compute every linear without
    its last 16 input columns (the scenarios decode at most 8 at once)."""
    _drops_k_block("decode", 17)
    return {}


def large_batch_stale_after_reload() -> dict:
    """A batch bucket captured at start-up (a CUDA graph replaying stale weight pointers): decode forwards of 17
    or more sequences keep computing with the start-up weights after a reload (the scenarios decode <= 8)."""
    _track_forwards()
    original = Engine.generate

    def generate(self, requests):
        if not hasattr(self, "_captured"):
            self._captured = copy.deepcopy(self.model)  # the weights at the first request: the "graph"
            self._workload_model = lambda phase: (self._captured if phase == "decode" and _FORWARD["m"] >= 17
                                                  else self.model)
        return original(self, requests)
    Engine.generate = generate
    return {}


def moe_expert_workspace_32() -> dict:
    """An MoE kernel whose per-expert workspace holds 32 tokens: in a prefill forward an expert that receives
    more drops the rest (their contribution from that expert is lost). Decode forwards stay below it."""
    _track_forwards()
    original = TinyModel.route

    def route(self, x, layer):
        ids, weights = original(self, x, layer)
        if _FORWARD["phase"] == "prefill":
            weights = weights.clone()
            for e in ids.unique().tolist():
                tok, slot = torch.where(ids == e)
                weights[tok[32:], slot[32:]] = 0
        return ids, weights
    TinyModel.route = route
    return {}


def bucketed_reduction_order() -> dict:
    """Correct but different: every linear accumulates in fp32 with a split-K that depends on the forward's
    token count (1 chunk up to 16 tokens, 4 to 128, 16 above; the chunks summed last to first), rounded once
    as the reference does: each addition one fp32 rounding, inside the bounds' accumulation term."""
    _track_forwards()

    def linear(self, x, prefix):
        xd = x.double()
        pqs = self.w.get(f"{prefix}.pre_quant_scale")
        if pqs is not None:
            xd = xd * pqs.double()
        w = (self._weight(prefix) * self._scale2(prefix)).float()
        xf = xd.float()
        m = _FORWARD["m"]
        chunks = 1 if m <= 16 else 4 if m <= 128 else 16
        step = -(-w.shape[1] // chunks)
        acc = torch.zeros(xf.shape[0], w.shape[0], dtype=torch.float32, device=x.device)
        for lo in reversed(range(0, w.shape[1], step)):
            acc = acc + xf[:, lo:lo + step] @ w[:, lo:lo + step].T
        return acc.double()
    TinyModel.linear = linear
    return {}
