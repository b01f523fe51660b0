"""Golden outputs of the reference model for the server scenarios, with the first-order sensitivities from
which ``conformance/server/bounds.py`` derives how far a correct engine may be from them.

The truth is the reference model in its exact mode (``TinyModel(act_dtype=float64)``: the checkpoint's
dequantized weights, no rounding between operations). For each prompt: its greedy continuation, each
chosen token's logprob, the reference's top-``K`` candidates at each step with their logit gaps to the
top-1, and for every MoE routing decision the gap between the k-th and (k+1)-th router logits.

**Rounding analysis.** A serving engine stores intermediates in BF16 where the reference model calls
``TinyModel._store``. An observer (:class:`RoundingAnalysis`) adds a zero perturbation leaf ``d_v`` to each
stored tensor ``v``, so one backward pass per output ``f`` gives ``df/dv`` for every store.
To first order an engine's ``f`` differs from the exact one by ``sum_i (df/dv_i) * e_i`` over its
individual rounding errors ``e_i``, each bounded by ``|e_i| <= c_i`` (Higham, *Accuracy and Stability of
Numerical Algorithms*, 2nd ed., 3.1). Modelling rounding errors as independent and mean zero (Higham and
Mary, "A New Approach to Probabilistic Rounding Error Analysis", SIAM J. Sci. Comput. 41(5), 2019),
Hoeffding's inequality gives ``P(|df| >= lam * sqrt(sum_i (df/dv_i * c_i)^2)) <= 2 exp(-lam^2 / 2)``.
This module computes the *variance proxies* ``sum_i (df/dv_i * c_i / unit)^2``, in the components
:data:`COMPONENTS`, whose unit roundoffs ``conformance/server/bounds.py`` applies, next to the check:

* ``bf16`` (unit ``2^-8``): every BF16 rounding an engine may make: the stored value (``|v|``; twice for
  ``silu(gate) * up``: activation and product), rounded products before a sum (rotary embedding:
  ``|q cos| + |rot(q) sin|``; MoE combine: ``(top_k + 1)`` roundings of at most ``sum_k |w_k y_k|``), the
  dequantized weight ``W * weight_scale_2`` rounded for a BF16 GEMM (one variable per weight element,
  ``|W_nk| * sum_t |df/dy_tn| |x_tk|``: the same rounded weight serves every token), and an AWQ input
  ``x * pre_quant_scale`` rounded (``|x'_tk| * |(df/dy @ W)_tk|``);
* ``accum`` (unit ``2^-23``, fp32 accumulation, one ulp per addition as tensor cores truncate): every
  reduction of length ``n`` (linear, attention scores and values, router, LM head) errs by at most
  ``(n + 2) * M`` with ``M`` the sum of the absolute products;
* ``tp2``, ``tp4``, ``tp8`` (unit ``2^-8``, added at that tensor-parallel size): row-parallel outputs
  (attention ``o_proj``, MLP ``down_proj``) when each rank's partial sum and the all-reduce's running sums
  are rounded to BF16 (the actual partials of contiguous input slices); the MoE combine, ``tp`` roundings
  of at most ``sum_k |w_k| A_k`` (``A_k`` bounds any rank's partial of expert ``k``'s output).

Discrete decisions are not differentiable: a greedy token whose gap to another candidate is inside that
gap's bound, or a routing decision whose router-logit gap is inside its bound, may legitimately go the
other way. The golden outputs record the gaps; :meth:`ExactModel.gap_variance` and :meth:`ExactModel.branch`
answer on demand, when an engine diverges (see ``conformance/server/golden.py``).
"""
from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass

import torch

from .checkpoint import load_checkpoint
from .model import ModelConfig, StoreObserver, TinyModel, shard_weights, validate_checkpoint

#: Sensitivity components, in this order, in every ``*_sens`` tensor (last dimension).
TP_SIZES = (2, 4, 8)
COMPONENTS = ("bf16", "accum") + tuple(f"tp{tp}" for tp in TP_SIZES)
TOP_K = 2


class _Store:
    """One stored tensor: its perturbation leaf and the per-element squared error weights of each component."""

    def __init__(self, kind: str, value: torch.Tensor, info, n: int, reduced: bool):
        self.kind, self.leaf = kind, torch.zeros_like(value, requires_grad=True)
        v = value.detach().abs()
        bf16 = v.pow(2) * (2 if kind == "act" else 1)
        accum, self.weight_operands, self.awq = None, None, kind == "linear_awq"
        tp_sq = None
        if kind == "sum":
            bf16 = bf16 + info.pow(2)
        elif kind == "combine":
            bf16 = bf16 + (n + 1) * info[0].pow(2)
            tp_sq = [tp * info[1].pow(2) for tp in TP_SIZES]  # tp partials and running sums, each <= sum_k |w_k| A_k
        elif kind in ("linear", "linear_awq"):
            x, w = info
            self.weight_operands = (x.abs(), w.abs(), w if self.awq else None)
            accum = ((n + 2) * (x.abs() @ w.abs().T)).pow(2)
            if reduced:
                tp_sq = [_partials_sq(x, w, tp) for tp in TP_SIZES]
        elif kind in ("dot", "router"):
            accum = ((n + 2) * info).pow(2)
        self.sq = [bf16, accum] + (tp_sq or [None] * len(TP_SIZES))

    def variances(self, g: torch.Tensor) -> torch.Tensor:
        """``[F, components]``: this store's contribution for F functions with gradients ``g [F, *shape]``."""
        g2 = g.pow(2).flatten(1)
        out = torch.stack([g2 @ c.flatten() if c is not None else torch.zeros(g.shape[0], dtype=torch.float64)
                           for c in self.sq], dim=1)
        if self.weight_operands is not None:
            x_abs, w_abs, w = self.weight_operands
            gl = g.reshape(g.shape[0], -1, w_abs.shape[0])
            # weight rounding: one variable per weight element, shared by all tokens
            out[:, 0] += (torch.einsum("ftn,tk->fnk", gl.abs(), x_abs) * w_abs).pow(2).flatten(1).sum(1)
            if w is not None:  # AWQ: x * pre_quant_scale rounded, one variable per input element
                out[:, 0] += ((gl @ w) * x_abs).pow(2).flatten(1).sum(1)
        return out


class RoundingAnalysis(StoreObserver):
    """Attach to an exact-mode TinyModel: a zero perturbation leaf per store, and what bounds its errors."""

    def __init__(self) -> None:
        self.stores: list[_Store] = []
        self.routers: list[torch.Tensor] = []

    def __call__(self, kind: str, value: torch.Tensor, info, n: int, reduced: bool) -> torch.Tensor:
        if kind not in ("round", "act", "sum", "combine", "dot", "router", "linear", "linear_awq"):
            raise ValueError(f"unknown store kind {kind!r}")
        store = _Store(kind, value, info, n, reduced)
        self.stores.append(store)
        out = value + store.leaf
        if kind == "router":
            self.routers.append(out)
        return out

    def variances(self, fs: list[torch.Tensor]) -> torch.Tensor:
        """``[len(fs), len(COMPONENTS)]`` variance proxies of the scalars ``fs`` (one backward each)."""
        leaves = [s.leaf for s in self.stores]
        per_store: list[list[torch.Tensor]] = [[] for _ in self.stores]
        for f in fs:
            for acc, leaf, g in zip(per_store, leaves, torch.autograd.grad(f, leaves, retain_graph=True, allow_unused=True)):
                acc.append(torch.zeros_like(leaf) if g is None else g.detach())
        out = torch.zeros(len(fs), len(COMPONENTS), dtype=torch.float64)
        for store, grads in zip(self.stores, per_store):
            out += store.variances(torch.stack(grads))
        return out


def _partials_sq(x: torch.Tensor, w: torch.Tensor, tp: int) -> torch.Tensor:
    """``sum_r p_r^2 + sum_j S_j^2`` per output element of ``x @ w^T`` split over ``tp`` ranks (contiguous
    slices of the input dimension, as a row-parallel linear): the rank partials ``p_r`` and the running
    sums ``S_j`` (j = 2 .. tp-1) an all-reduce rounds."""
    k = x.shape[-1]
    if k % tp:
        return torch.full((x.shape[0], w.shape[0]), float("inf"), dtype=torch.float64)
    parts = torch.stack([x[:, r * k // tp:(r + 1) * k // tp] @ w[:, r * k // tp:(r + 1) * k // tp].T for r in range(tp)])
    running = parts.cumsum(0)[1:-1]
    return parts.pow(2).sum(0) + running.pow(2).sum(0)


class _RouterTap(StoreObserver):
    """Keeps the router logits of a forward (no analysis)."""

    def __init__(self) -> None:
        self.routers: list[torch.Tensor] = []

    def __call__(self, kind, value, info, n, reduced):
        if kind == "router":
            self.routers.append(value.detach())
        return value


@dataclass
class GoldenSet:
    """The reference's greedy outputs for ``prompt_ids`` on one checkpoint (P prompts, N steps). ``*_var``
    hold the variance proxies (last dimension: :data:`COMPONENTS`) of the quantity next to them."""

    checkpoint_digest: str
    prompt_ids: list[list[int]]
    output_ids: torch.Tensor      # [P, N] int64
    logprobs: torch.Tensor        # [P, N] fp64: log_softmax of the chosen token
    logprob_var: torch.Tensor     # [P, N, C]
    top_ids: torch.Tensor         # [P, N, K] int64: the reference's K best tokens (top_ids[..., 0] = output_ids)
    top_gaps: torch.Tensor        # [P, N, K] fp64: logit(top-1) - logit(top-k) >= 0
    route_gaps: torch.Tensor      # [P, T, L] fp64: k-th minus (k+1)-th router logit at position t; +inf: none
    route_var: torch.Tensor       # [P, T, L, C]

    @property
    def max_new_tokens(self) -> int:
        return int(self.output_ids.shape[1])


@dataclass
class ForcedPath:
    """:meth:`ExactModel.forced`: per step the token's raw and temperature-scaled logprob with variance proxies
    (``[N]`` and ``[N, C]``), and every routing decision ``(position, layer, gap, variance proxies)``."""

    raw: torch.Tensor
    raw_var: torch.Tensor
    scaled: torch.Tensor
    scaled_var: torch.Tensor
    routes: list[tuple[int, int, float, torch.Tensor]]


def checkpoint_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the sorted tensor names, dtypes, shapes and bytes (independent of the file layout)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class ExactModel:
    """A checkpoint loaded once (all weights, one process) for golden outputs and on-demand gaps."""

    def __init__(self, model_path: str):
        ckpt = load_checkpoint(model_path)
        self.cfg: ModelConfig = validate_checkpoint(ckpt)
        self.digest = checkpoint_digest(ckpt.tensors)
        self.weights = shard_weights(self.cfg, ckpt.tensors)
        self._plain = TinyModel(self.cfg, self.weights, act_dtype=torch.float64)

    def greedy(self, prompts: list[list[int]], steps: int) -> list[list[int]]:
        """Greedy continuations of all prompts (packed into one forward per step)."""
        seqs = [list(p) for p in prompts]
        with torch.no_grad():
            for _ in range(steps):
                last = self._plain.last_logits([torch.tensor(s) for s in seqs])
                for s, row in zip(seqs, last):
                    s.append(int(torch.argmax(row)))
        return [s[len(p):] for s, p in zip(seqs, prompts)]

    def analyse(self, prompt: list[int], continuation: list[int]) -> tuple[RoundingAnalysis, torch.Tensor]:
        """One forward of ``prompt + continuation[:-1]`` with the rounding analysis: the logits ``[N, V]`` of
        the N steps (the analysis graph is kept for :meth:`RoundingAnalysis.variances`)."""
        analysis = RoundingAnalysis()
        with self._using(observer=analysis), torch.enable_grad():
            logits = self._plain.logits([torch.tensor(list(prompt) + list(continuation[:-1]))])
        return analysis, logits[len(prompt) - 1:]

    @contextlib.contextmanager
    def _using(self, observer=None, forced_routes=None):
        """The one exact model (weights decoded once) with an observer / forced routes for one forward."""
        self._plain.observer, self._plain.forced_routes = observer, dict(forced_routes or {})
        try:
            yield self._plain
        finally:
            self._plain.observer, self._plain.forced_routes = None, {}

    def gap_variance(self, prompt: list[int], continuation: list[int], step: int, token: int) -> tuple[float, torch.Tensor]:
        """(gap, variance proxies) of ``logit(continuation[step]) - logit(token)`` at ``step`` (on demand, for
        a token outside the stored top-K)."""
        analysis, logits = self.analyse(prompt, continuation)
        with torch.enable_grad():
            gap = logits[step, continuation[step]] - logits[step, token]
        return float(gap.detach()), analysis.variances([gap])[0]

    def branch(self, prompt: list[int], continuation: list[int],
               forced: dict[tuple[int, int], tuple[int, int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Step logits ``[N, V]`` and router logits (per layer ``[T, E]``) of the reference's path with the
        routing decisions ``forced`` ((layer, position) -> (expert out, expert in)) taken the other way;
        every other decision is recomputed, so the flips' consequences downstream are included."""
        tap = _RouterTap()
        with self._using(observer=tap, forced_routes=forced) as model, torch.no_grad():
            logits = model.logits([torch.tensor(list(prompt) + list(continuation[:-1]))])
        return logits[len(prompt) - 1:], tap.routers

    def forced(self, prompt: list[int], continuation: list[int], temperature: float) -> ForcedPath:
        """The reference's answer for a continuation it did not choose (a sampled one): at each step the
        logprob of the continuation's token, raw (``log_softmax(logits)``) and temperature-scaled
        (``log_softmax(logits / temperature)``), and the path's routing gaps, each with its variance proxies."""
        analysis, logits = self.analyse(prompt, continuation)
        n = len(continuation)
        with torch.enable_grad():
            raw, scaled = torch.log_softmax(logits, -1), torch.log_softmax(logits / temperature, -1)
            fs = [raw[j, continuation[j]] for j in range(n)] + [scaled[j, continuation[j]] for j in range(n)]
            routes = []
            for layer, router in enumerate(analysis.routers):
                ranked = torch.topk(router.detach(), self.cfg.top_k + 1, dim=-1).indices
                for t in range(router.shape[0]):
                    fs.append(router[t, ranked[t, -2]] - router[t, ranked[t, -1]])
                    routes.append((t, layer))
        values, var = torch.stack([f.detach() for f in fs]), analysis.variances(fs)
        return ForcedPath(values[:n], var[:n], values[n:2 * n], var[n:2 * n],
                          [(t, layer, float(values[2 * n + k]), var[2 * n + k]) for k, (t, layer) in enumerate(routes)])

    def golden(self, prompts: list[list[int]], steps: int, top_k: int = TOP_K, variances: bool = True) -> GoldenSet:
        """Greedy outputs, logprobs, top-K logit gaps and routing gaps, with the variance proxies of the
        logprobs and routing gaps (``variances=False``: values only, zeros instead; for cheap re-checks).
        Variances of other gaps and other routings (:meth:`branch`) are computed on demand, when an engine
        diverges."""
        p, k, c = len(prompts), min(top_k, self.cfg.vocab_size), len(COMPONENTS)
        t_max, layers = max(len(x) for x in prompts) + steps - 1, self.cfg.num_layers
        out = GoldenSet(self.digest, [list(x) for x in prompts], torch.zeros(p, steps, dtype=torch.int64),
                        torch.zeros(p, steps, dtype=torch.float64), torch.zeros(p, steps, c, dtype=torch.float64),
                        torch.zeros(p, steps, k, dtype=torch.int64), torch.zeros(p, steps, k, dtype=torch.float64),
                        torch.full((p, t_max, layers), float("inf"), dtype=torch.float64),
                        torch.zeros(p, t_max, layers, c, dtype=torch.float64))
        for i, (prompt, cont) in enumerate(zip(prompts, self.greedy(prompts, steps))):
            analysis, logits = self.analyse(prompt, cont)
            top = torch.topk(logits.detach(), k, dim=-1)
            if top.indices[:, 0].tolist() != cont:  # both fp64 on the same rows; only an exact tie could do this
                raise RuntimeError(f"prompt {i}: greedy path {cont} and the analysed logits' argmax "
                                   f"{top.indices[:, 0].tolist()} disagree (an exact tie); use other prompts")
            out.output_ids[i], out.top_ids[i] = torch.tensor(cont), top.indices
            out.top_gaps[i] = top.values[:, :1] - top.values
            with torch.enable_grad():
                logprobs = torch.log_softmax(logits, dim=-1)
                fs = [logprobs[j, cont[j]] for j in range(steps)]
                routes = []
                for layer, router in enumerate(analysis.routers):  # [T, E]: the k-th vs the (k+1)-th expert
                    ranked = torch.topk(router.detach(), self.cfg.top_k + 1, dim=-1).indices
                    for t in range(router.shape[0]):
                        fs.append(router[t, ranked[t, -2]] - router[t, ranked[t, -1]])
                        routes.append((t, layer))
            values = torch.stack([f.detach() for f in fs])
            var = analysis.variances(fs) if variances else torch.zeros(len(fs), c, dtype=torch.float64)
            out.logprobs[i], out.logprob_var[i] = values[:steps], var[:steps]
            for n, (t, layer) in enumerate(routes):
                out.route_gaps[i, t, layer] = values[steps + n]
                out.route_var[i, t, layer] = var[steps + n]
        return out
