"""What the truth adds to transformers' own modules to see every BF16 store of a serving engine
(:mod:`reference_impl.truth.stores`) and every routing decision, without changing what they compute:

* forward hooks on every ``nn.Linear`` (a ``linear`` store of its output, operands ``(x, W)``: the AWQ scale is
  folded into ``W``, which leaves every term of the rounding model unchanged) and every RMSNorm (``norm``);
  a forward pre-hook on the MLP ``down_proj`` (``act``: the ``silu(gate) * up`` product is its input); a hook
  on the MoE block of DeepSeek-V3 (``round``: routed plus shared experts);
* the attention function ``nvfp4_truth`` (transformers' ``AttentionInterface``): eager attention with the
  scores, probabilities and output as ``dot`` / ``round`` / ``dot`` stores;
* the experts function ``nvfp4_truth`` (``ExpertsInterface``): each routed expert's gate, up and down linears
  (weights dequantized on demand: only the experts tokens reach), its ``act``, the weighted ``combine``;
* the rotary embedding (``apply_rotary_pos_emb`` of the architecture's modeling module, wrapped): the tables
  ``cos`` / ``sin`` as ``round`` stores and the rotated q and k as ``sum`` stores (computed in the
  de-interleaved form, bit for bit what transformers computes);
* a hook on the router: its logits a ``router`` store; the routing weights recomputed differentiably from them
  (for the chosen experts, and checked equal to transformers' own); the near-tie gaps of every decision
  (:class:`RouteDecision`) and, in a branch, decisions forced the other way.

Outside :func:`recording` every hook is a no-op and the functions compute what transformers' eager ones do.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from reference_impl.model.architectures import ModelConfig
from reference_impl.moe.routing import allowed_by_groups, group_scores
from reference_impl.truth import attention_kernel, by_hand
from reference_impl.truth.by_hand import primal, rotate as _rotate
from reference_impl.truth.stores import Store

NAME = "nvfp4_truth"
_ACTIVE: contextvars.ContextVar["Recorder | None"] = contextvars.ContextVar("nvfp4_truth_recorder", default=None)


@dataclass
class RouteDecision:
    """The decisions of one kind (``expert``: k-th vs (k+1)-th expert; ``group``: DeepSeek's topk_group-th vs
    next group) at every position of one layer: ``gaps [T]`` (differentiable while recording) and per
    position the flip taking it the other way (``(drop, add)``)."""

    layer: int
    kind: str
    gaps: torch.Tensor
    flips: list[tuple[int, int]]


@dataclass
class Recorder:
    """Stores and routing decisions of one forward (the engine sets one per layer call)."""

    cfg: ModelConfig
    analysis: bool
    forced: dict = field(default_factory=dict)  # (slot, position) -> (drop, add)
    layer: int = -1
    stores: list[Store] = field(default_factory=list)
    routes: list[RouteDecision] = field(default_factory=list)
    #: a :class:`reference_impl.truth.probes.Probe`: every store gets a random tangent (forward-mode probes)
    probe: object = None

    @property
    def observing(self) -> bool:
        """Whether stores are observed (rounding analysis or probes)."""
        return self.analysis or self.probe is not None

    def store(self, value: torch.Tensor, kind: str, info=None, n: int = 0, reduced: bool = False) -> torch.Tensor:
        if self.probe is not None:
            return self.probe.perturb(kind, value, info, n, reduced)
        if not self.analysis:
            return value
        with torch.no_grad():
            info = info() if callable(info) else info
        s = Store(kind, value, info, n, reduced)
        self.stores.append(s)
        return value + s.leaf


def decisions_per_layer(cfg: ModelConfig) -> int:
    return 2 if cfg.router == "sigmoid_grouped" else 1


def slot(cfg: ModelConfig, layer: int, kind: str) -> int:
    return layer * decisions_per_layer(cfg) + (1 if kind == "group" else 0)


@contextlib.contextmanager
def recording(rec: Recorder):
    token = _ACTIVE.set(rec)
    try:
        yield rec
    finally:
        _ACTIVE.reset(token)


def active() -> Recorder | None:
    return _ACTIVE.get()


# ----------------------------------------------------------------------------------------- attention
#: score elements of one block of queries (fp64: 2 GiB): a long sequence's attention goes in blocks of queries, so
#: its memory grows like T, not T^2 (every store is elementwise or per query row: the blocks change nothing)
ATTENTION_BLOCK_ELEMENTS = 1 << 28


def truth_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager causal attention ``[b, h, t, d]`` with its three stores, in blocks of queries; the mask is causal by
    construction (the truth never pads)."""
    rec = active() or Recorder(None, False)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    tq, tk = query.shape[-2], key.shape[-2]
    if _replicated(rec, query) and attention_kernel.available(query) and tk * tk < 2 ** 31:
        out = by_hand.probed_attention_kernel(rec.probe, query, key, value, scaling, tk)  # no T^2 in memory
        return out.transpose(1, 2).contiguous(), None
    rows = max(1, ATTENTION_BLOCK_ELEMENTS // (query.shape[0] * query.shape[1] * tk))
    causal = torch.ones(tq, tk, dtype=torch.bool, device=query.device).tril(tk - tq)
    # under probes a block of queries takes the keys up to its last query only: the keys after it are masked for
    # every query of the block (probability 0: no value, no store's error). Elsewhere every block takes every key,
    # so the values do not depend on the blocking (the softmax runs in fp32, as transformers', and its sums would
    # round otherwise over fewer keys: ~1e-7)
    trim = rec.probe is not None
    block = _probed_block if _replicated(rec, query) else _attention_block
    blocks = []
    for lo in range(0, tq, rows):
        seen = min(tk, tk - tq + lo + rows) if trim else tk
        blocks.append(block(rec, query[:, :, lo:lo + rows], key[:, :, :seen], value[:, :, :seen],
                            causal[lo:lo + rows, :seen], scaling, tk))
    out = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)
    return out.transpose(1, 2).contiguous(), None


def _replicated(rec: Recorder, x: torch.Tensor) -> bool:
    """Whether ``x`` is laid out ``[sequences x replicas, ...]`` for the probes (one primal per sequence)."""
    return rec.probe is not None and rec.probe.replicated(x)


def _probed_block(rec: Recorder, query, key, value, causal, scaling, keys: int):
    return by_hand.probed_attention_block(rec.probe, query, key, value, causal, scaling, keys)


def _attention_block(rec: Recorder, query, key, value, causal, scaling, keys: int):
    # ``keys``: the sequence's keys, the length of the output's dot products in the rounding model whatever block
    scores = rec.store(torch.matmul(query, key.transpose(2, 3)) * scaling, "dot",
                       lambda: torch.matmul(primal(query).abs(), primal(key).abs().transpose(2, 3)) * scaling,
                       query.shape[-1])
    scores = scores.masked_fill(~causal, float("-inf"))
    probs = rec.store(F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype), "round")
    return rec.store(torch.matmul(probs, value), "dot", lambda: torch.matmul(primal(probs).abs(), primal(value).abs()),
                     keys)


# ----------------------------------------------------------------------------------------- experts
def truth_experts(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """The routed experts of one MoE layer; ``self._truth_weights(e)`` gives expert e's fp64 (gate, up, down)."""
    rec = active() or Recorder(None, False)
    weights = rec.store(top_k_weights.to(hidden_states.dtype), "round")
    out = torch.zeros_like(hidden_states)
    mag = hidden_states.new_zeros(2, *hidden_states.shape)
    for e in sorted(set(top_k_index.flatten().tolist())):
        tok, slot_ = torch.where(top_k_index == e)
        wg, wu, wd = self._truth_weights(e)
        x = hidden_states[tok]
        kind = self._truth_kind
        g = rec.store(x @ wg.T, kind, lambda: (x, wg, tok), x.shape[-1])  # tok: the rows' positions (probes)
        u = rec.store(x @ wu.T, kind, lambda: (x, wu, tok), x.shape[-1])
        h = rec.store(F.silu(g) * u, "act")
        y = rec.store(h @ wd.T, kind, lambda: (h, wd, tok), h.shape[-1])
        w = weights[tok, slot_][:, None]
        contribution = y * w
        out = out.index_add(0, tok, contribution)
        if rec.observing:
            with torch.no_grad():
                mag[0].index_add_(0, tok, contribution.detach().abs())
                mag[1].index_add_(0, tok, (h.detach().abs() @ wd.abs().T) * w.detach().abs())
    return rec.store(out, "combine", lambda: mag, top_k_index.shape[-1], reduced=True)


# ----------------------------------------------------------------------------------------- rotary
def rope_wrapper(original, interleave: bool):
    def apply(q, k, cos, sin, *args, **kwargs):
        rec = active()
        if rec is None or not rec.observing:
            return original(q, k, cos, sin, *args, **kwargs)
        if _replicated(rec, q) and _replicated(rec, k):
            return by_hand.probed_rotary(rec.probe, q, k, cos, sin, interleave)
        if rec.probe is not None:  # the tables serve every replica of a probed batch: each its own draws
            cos, sin = cos.expand(q.shape[0], *cos.shape[1:]), sin.expand(q.shape[0], *sin.shape[1:])
        cos, sin = rec.store(cos, "round"), rec.store(sin, "round")
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # [b, t, d] -> [b, 1, t, d] (q, k: [b, h, t, d])
        out = []
        for x in (q, k):
            mag = lambda x=x: _rotate(x, c, 0 * s, interleave).abs() + _rotate(x, 0 * c, s, interleave).abs()  # noqa: E731
            out.append(rec.store(_rotate(x, c, s, interleave), "sum", mag))
        return tuple(out)
    apply._nvfp4_truth_original = original
    return apply


# ----------------------------------------------------------------------------------------- routing
def _softmax_weights(cfg: ModelConfig, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    w = torch.softmax(logits.float(), dim=-1).gather(1, ids)
    if cfg.norm_topk_prob or cfg.arch == "mixtral":
        w = w / w.sum(dim=-1, keepdim=True)
    return w


def _sigmoid_weights(cfg: ModelConfig, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    w = torch.sigmoid(logits.float()).gather(1, ids)
    if cfg.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * cfg.routed_scaling_factor


def _kth_gap(values: torch.Tensor, k: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Gap between the k-th and (k+1)-th largest entry of each row, and the (k-th, (k+1)-th) index pairs."""
    t, e = values.shape
    if t == 0 or e <= k:
        return values.new_full((t,), float("inf")), [(-1, -1)] * t
    ranked = torch.topk(values.detach(), k + 1, dim=-1).indices
    gaps = values.gather(1, ranked[:, k - 1:k])[:, 0] - values.gather(1, ranked[:, k:k + 1])[:, 0]
    gaps = torch.where(torch.isfinite(values.detach().gather(1, ranked[:, k:k + 1])[:, 0]), gaps,
                       torch.full_like(gaps, float("inf")))
    return gaps, [(int(a), int(b)) for a, b in ranked[:, k - 1:k + 1].tolist()]


def route(cfg: ModelConfig, rec: Recorder, x: torch.Tensor, logits: torch.Tensor, weight: torch.Tensor,
          bias: torch.Tensor | None, ids: torch.Tensor, hf_weights: torch.Tensor):
    """Recorded routing of one layer: ``(logits, weights, ids)`` to continue with."""
    layer, k = rec.layer, cfg.top_k
    logits = rec.store(logits.double(), "router",
                       lambda: x.detach().double().abs() @ weight.detach().double().abs().T, x.shape[-1])
    forced = {key: flip for key, flip in rec.forced.items() if key[0] // decisions_per_layer(cfg) == layer}
    if cfg.router == "sigmoid_grouped":
        choice = torch.sigmoid(logits.float()) + bias.float()
        groups = None
        if 1 < cfg.n_group and cfg.topk_group < cfg.n_group:
            gs = group_scores(choice, cfg.n_group)
            gaps, flips = _kth_gap(gs, cfg.topk_group)
            rec.routes.append(RouteDecision(layer, "group", gaps, flips))
            groups = torch.topk(gs.detach(), cfg.topk_group, dim=-1).indices
            for (s, t), (drop, add) in forced.items():
                if s == slot(cfg, layer, "group"):
                    groups[t][groups[t] == drop] = add
        allowed = allowed_by_groups(choice.detach(), cfg.n_group, cfg.topk_group, groups)
        masked = choice.masked_fill(~allowed, float("-inf"))
        gaps, flips = _kth_gap(masked, k)
        rec.routes.append(RouteDecision(layer, "expert", gaps, flips))
        if forced:
            regroup = sorted({t for (s, t) in forced if s == slot(cfg, layer, "group")})
            ids = ids.clone()
            if regroup:
                ids[regroup] = torch.topk(masked.detach()[regroup], k, dim=-1).indices
        weights_of = _sigmoid_weights
    else:
        gaps, flips = _kth_gap(logits, k)
        rec.routes.append(RouteDecision(layer, "expert", gaps, flips))
        weights_of = _softmax_weights
        if forced:
            ids = ids.clone()
    for (s, t), (drop, add) in forced.items():
        if s == slot(cfg, layer, "expert"):
            ids[t][ids[t] == drop] = add
    weights = weights_of(cfg, logits, ids)
    if not forced and not torch.equal(weights.detach().to(hf_weights.dtype), hf_weights.detach()):
        raise RuntimeError(f"layer {layer}: routing weights recomputed from the router logits differ from "
                           f"transformers' own (has its router changed?)")
    return logits, weights.to(hf_weights.dtype), ids


def router_hook(cfg: ModelConfig):
    def hook(module, args, output):
        rec = active()
        if rec is None:
            return output
        logits, hf_weights, ids = output
        bias = getattr(module, "e_score_correction_bias", None)
        x = args[0].reshape(-1, module.weight.shape[1])
        return route(cfg, rec, x, logits, module.weight, bias, ids, hf_weights)
    return hook


# ----------------------------------------------------------------------------------------- module hooks
def linear_hook(kind: str, reduced: bool):
    def hook(module, args, output):
        rec = active()
        if rec is None:
            return output
        x = args[0]
        return rec.store(output, kind, lambda: (x.detach(), module.weight.detach()), x.shape[-1], reduced)
    return hook


def norm_hook(module, args, output):
    rec = active()
    return output if rec is None else rec.store(output, "norm")


def act_pre_hook(module, args):
    rec = active()
    if rec is None:
        return None
    return (rec.store(args[0], "act"),) + tuple(args[1:])


def round_hook(module, args, output):
    rec = active()
    return output if rec is None else rec.store(output, "round")


_REGISTERED = set()


def register(modeling_module) -> None:
    """Register the attention and experts functions and wrap the rotary functions of ``modeling_module`` (once)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.modeling_utils import AttentionInterface

    if not _REGISTERED:
        AttentionInterface.register(NAME, truth_attention)
        ALL_EXPERTS_FUNCTIONS.register(NAME, truth_experts)
        _REGISTERED.add("interfaces")
    if modeling_module.__name__ in _REGISTERED:
        return
    for fn, interleave in (("apply_rotary_pos_emb", False), ("apply_rotary_pos_emb_interleave", True)):
        original = getattr(modeling_module, fn, None)
        if original is not None and not hasattr(original, "_nvfp4_truth_original"):
            setattr(modeling_module, fn, rope_wrapper(original, interleave))
    _REGISTERED.add(modeling_module.__name__)
