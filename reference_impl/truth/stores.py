"""The rounding model behind the golden bounds: one :class:`Store` per place where a serving engine keeps an
intermediate in BF16, with the per-element error weights of each component of
:data:`reference_impl.truth.golden.COMPONENTS` (the derivation is in reference_impl/truth/golden.py's docstring).

A store adds a zero perturbation leaf ``d_v`` to its value; the gradients ``df/dv`` of F outputs, stacked
``[F, *shape]``, give the store's contribution ``[F, components]`` to the variance proxies
(:meth:`Store.variances`). Store kinds:

=============== ==============================================================================================
``round``       a value rounded once: ``|v|``
``act``, ``norm`` two roundings of ``|v|``: ``silu(gate) * up`` (activation and product); an RMSNorm's output
                (the normalised row and its product with the weight: both errors weigh ``|df/dout| |out|``)
``sum``         a rounded sum of two rounded products (rotary embedding): ``|v|`` and the products'
                ``|q cos| + |rot(q) sin|``
``combine``     the MoE weighted sum of ``top_k`` expert outputs: ``top_k + 1`` roundings of ``sum_k |w_k y_k|``;
                at TPn ``tp`` roundings of ``sum_k |w_k| A_k``
``linear``      an NVFP4 linear ``y = x W^T``: ``|y|``; fp32 accumulation ``(n + 2) |x| |W|^T``; the rounded BF16
                weight, one variable per element shared by every token; row-parallel partial sums at TPn
``linear_awq``  as ``linear``, plus the AWQ input ``x * pre_quant_scale`` rounded (one variable per element)
``linear_exact`` a linear excluded from quantization (BF16 weights: exact in a BF16 GEMM): as ``linear``
                without the weight term
``dot``,        other dot products (attention scores and values, the LM head, the router): ``|v|`` and
``router``      fp32 accumulation ``(n + 2) sum |a b|``
=============== ==============================================================================================
"""
from __future__ import annotations

import torch

TP_SIZES = (2, 4, 8)
#: unit roundoffs of the model: a BF16 store (8 significant bits) and one fp32 addition (tensor cores truncate)
U_BF16 = 2.0 ** -8
U_ACCUM = 2.0 ** -23
KINDS = ("round", "act", "norm", "sum", "combine", "dot", "router", "linear", "linear_awq", "linear_exact")
NUM_COMPONENTS = 2 + len(TP_SIZES)
#: the weight term with the sensitivities' signs (exact) instead of |a| |x| (an upper bound, the default): only
#: tests/reference/test_truth_probes.py sets it, to compare the probes' unbiased estimate with its exact value
WEIGHT_TERM_SIGNED = False
_CHUNK_ELEMENTS = 1 << 25  # elements of one temporary of the weight term (256 MiB in fp64)


class Store:
    """One stored tensor: its perturbation leaf and the per-element squared error weights of each component."""

    def __init__(self, kind: str, value: torch.Tensor, info, n: int, reduced: bool):
        if kind not in KINDS:
            raise ValueError(f"unknown store kind {kind!r}")
        self.kind, self.leaf = kind, torch.zeros_like(value, requires_grad=True)
        with torch.no_grad():
            self.sq, self.weight_operands = error_weights(kind, value, info, n, reduced)

    def variances(self, g: torch.Tensor) -> torch.Tensor:
        """``[F, components]``: this store's contribution for F functions with gradients ``g [F, *shape]``."""
        g2 = g.pow(2).flatten(1)
        out = torch.stack([g2 @ c.flatten() if c is not None else g2.new_zeros(g.shape[0]) for c in self.sq], dim=1)
        if self.weight_operands is not None:
            x, w_abs, w = self.weight_operands
            x_abs = x.abs()
            gl = g.reshape(g.shape[0], -1, w_abs.shape[0])
            # the rounded weight's sensitivity is sum_t a_tn x_tk; |a| |x| bounds it (the exact term, with signs,
            # when WEIGHT_TERM_SIGNED: what the forward-mode probes estimate, for their self-test)
            out[:, 0] += weight_term(gl, x, w_abs) if WEIGHT_TERM_SIGNED else weight_term(gl.abs(), x_abs, w_abs)
            if w is not None:  # AWQ: x * pre_quant_scale rounded, one variable per input element
                xa = x_abs
                rows = max(1, _CHUNK_ELEMENTS // xa.numel())
                out[:, 0] += torch.cat([((c @ w) * xa).pow(2).flatten(1).sum(1) for c in gl.split(rows)])
        return out


def covering_tp(tp: int) -> int | None:
    """The TP size whose partial-sum terms bound a TPn engine's (``tp`` itself when modelled, else the next larger
    one); None when ``tp`` is above every modelled size."""
    return next((t for t in TP_SIZES if t >= tp), None)


def error_weights(kind: str, value: torch.Tensor, info, n: int, reduced: bool, tp_sizes=TP_SIZES):
    """``(sq, weight_operands)`` of one store: ``sq`` the per-element squared error weights of each component
    (None where a component has none; the TPn terms only for ``tp_sizes``), ``weight_operands`` ``(x, |W|, W or None)`` of an NVFP4 linear's
    weight (and AWQ input) rounding terms, else None (the table in the module docstring)."""
    v = value.detach().abs()
    bf16 = v.pow(2) * (2 if kind in ("act", "norm") else 1)
    accum, weight_operands, tp_sq = None, None, None
    if kind == "sum":
        bf16 = bf16 + info.pow(2)
    elif kind == "combine":
        bf16 = bf16 + (n + 1) * info[0].pow(2)
        tp_sq = [tp * info[1].pow(2) if tp in tp_sizes else None for tp in TP_SIZES]  # partials, running sums
    elif kind.startswith("linear"):
        x, w = info[0], info[1]
        x = x.reshape(-1, x.shape[-1])
        if kind != "linear_exact":
            x, w = x.detach(), w.detach()  # kept for the backward's weight terms: never part of the graph
            weight_operands = (x, w.abs(), w if kind == "linear_awq" else None)
        accum = ((n + 2) * (x.abs() @ w.abs().T)).pow(2).reshape(value.shape)
        if reduced:
            tp_sq = [partials_sq(x, w, tp).reshape(value.shape) if tp in tp_sizes else None for tp in TP_SIZES]
    elif kind in ("dot", "router"):
        accum = ((n + 2) * info).pow(2)
    return [bf16, accum] + (tp_sq or [None] * len(TP_SIZES)), weight_operands


def std_of_squares(sq: list, shape, tp: int = 1) -> torch.Tensor:
    """``sqrt(U_BF16^2 sq[0] + U_ACCUM^2 sq[1] + U_BF16^2 sq[TP tp])``: a store's standard deviation from
    :func:`error_weights`' squared error weights (the components the probes draw at ``tp``)."""
    var = U_BF16 ** 2 * sq[0]
    if sq[1] is not None:
        var = var + U_ACCUM ** 2 * sq[1].reshape(shape)
    if tp > 1 and sq[2 + TP_SIZES.index(tp)] is not None:
        var = var + U_BF16 ** 2 * sq[2 + TP_SIZES.index(tp)].reshape(shape)
    return var.sqrt()


def store_std(kind: str, value: torch.Tensor, info, n: int, reduced: bool, tp: int = 1):
    """``(std, weight_operands)`` of one store for the probes: the per-element standard deviation of its BF16,
    accumulation and (at ``tp`` > 1) partial-sum roundings, ``sqrt(U_BF16^2 sq[0] + U_ACCUM^2 sq[1] + ...)`` of
    :func:`error_weights`, in fewer passes over the tensor (``hypot`` of the two magnitudes, no squares kept);
    the weight operands as there. A store with a TP term, and the MoE ``combine``, through ``error_weights``."""
    tp_term = tp > 1 and (kind == "combine" or (reduced and kind.startswith("linear")))
    if tp_term or kind == "combine":
        sq, operands = error_weights(kind, value, info, n, reduced, (tp,) if tp > 1 else ())
        return std_of_squares(sq, value.shape, tp), operands
    v = value.detach()
    if kind == "round":
        return v.abs().mul_(U_BF16), None
    if kind in ("act", "norm"):  # two roundings of |v|
        return v.abs().mul_(U_BF16 * 2 ** 0.5), None
    if kind == "sum":
        return torch.hypot(v, info).mul_(U_BF16), None
    operands = None
    if kind.startswith("linear"):
        x, w = info[0].detach(), info[1].detach()
        x = x.reshape(-1, x.shape[-1])
        w_abs = w.abs()
        info = (x.abs() @ w_abs.T).reshape(value.shape)
        if kind != "linear_exact":
            operands = (x, w_abs, w if kind == "linear_awq" else None)
    elif kind not in ("dot", "router"):
        raise ValueError(f"unknown store kind {kind!r}")
    return torch.hypot(v * U_BF16, info * (U_ACCUM * (n + 2))), operands


def weight_term(a: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``[F]``: ``sum_{n,k} (w_nk sum_t a_ftn x_tk)^2`` for ``a [F, T, N]``, ``x [T, K]``, ``w [N, K]`` (all >= 0):
    the weight rounding's variance, one variable per weight element shared by the T tokens. Never builds
    ``[F, N, K]``: with ``Q_nts = sum_k w_nk^2 x_tk x_sk`` it is ``sum_{t,s,n} a_ftn a_fsn Q_nts`` (cost
    ``N K T^2 + F N T^2``), or, where that is dearer, the direct form in chunks of F (cost ``F N K T``)."""
    f, t, n = a.shape
    k = x.shape[1]
    if t * (k + f) <= f * k:
        w2 = w.pow(2)
        out = a.new_zeros(f)
        rows = max(1, _CHUNK_ELEMENTS // max(1, t * k))
        for lo in range(0, t, rows):  # Q in blocks of t: [N, tb, T]
            xt = x[lo:lo + rows]
            q = (w2 @ (xt[:, None, :] * x[None, :, :]).reshape(-1, k).T).view(n, xt.shape[0], t)
            out += torch.einsum("ftn,fsn,nts->f", a[:, lo:lo + rows], a, q)
        return out
    per = n * k
    return torch.cat([(torch.einsum("ftn,tk->fnk", c, x) * w).pow(2).flatten(1).sum(1)
                      for c in a.split(max(1, _CHUNK_ELEMENTS // per))])


def partials_sq(x: torch.Tensor, w: torch.Tensor, tp: int) -> torch.Tensor:
    """``sum_r p_r^2 + sum_j S_j^2`` per output element of ``x @ w^T`` split over ``tp`` ranks (contiguous
    slices of the input dimension, as a row-parallel linear): the rank partials ``p_r`` and the running
    sums ``S_j`` (j = 2 .. tp-1) an all-reduce rounds."""
    k = x.shape[-1]
    if k % tp:
        return torch.full((*x.shape[:-1], w.shape[0]), float("inf"), dtype=torch.float64, device=x.device)
    parts = torch.stack([x[..., r * k // tp:(r + 1) * k // tp] @ w[:, r * k // tp:(r + 1) * k // tp].T for r in range(tp)])
    running = parts.cumsum(0)[1:-1]
    return parts.pow(2).sum(0) + running.pow(2).sum(0)


def batched_grads(outputs: list[torch.Tensor], grad_outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                  chunk: int | None = None) -> list[torch.Tensor]:
    """Gradients ``[F, *input.shape]`` of F output combinations (``grad_outputs[i]``: ``[F, *outputs[i].shape]``)
    with respect to ``inputs``, by batched backward passes of at most ``chunk`` rows (zeros where unused)."""
    f = grad_outputs[0].shape[0]
    chunk = chunk or f
    parts: list[list[torch.Tensor]] = [[] for _ in inputs]
    for lo in range(0, f, chunk):
        gs = torch.autograd.grad(outputs, inputs, [g[lo:lo + chunk] for g in grad_outputs], retain_graph=True,
                                 allow_unused=True, is_grads_batched=True)
        for acc, x, g in zip(parts, inputs, gs):
            rows = min(chunk, f - lo)
            acc.append(g.detach() if g is not None else x.new_zeros(rows, *x.shape))
    return [torch.cat(p) for p in parts]


class RoundingAnalysis:
    """A :class:`reference_impl.model.StoreObserver` for the hand-written model's exact mode: a zero perturbation
    leaf per store (the independent path the truth's instrumented transformers model is checked against)."""

    def __init__(self) -> None:
        self.stores: list[Store] = []
        self.routers: list[torch.Tensor] = []

    def __call__(self, kind: str, value: torch.Tensor, info, n: int, reduced: bool) -> torch.Tensor:
        store = Store(kind, value, info, n, reduced)
        self.stores.append(store)
        out = value + store.leaf
        if kind == "router":
            self.routers.append(out)
        return out

    def variances(self, fs: list[torch.Tensor]) -> torch.Tensor:
        """``[len(fs), components]`` variance proxies of the scalars ``fs`` (one batched backward)."""
        f = torch.stack(fs)
        grads = batched_grads([f], [torch.eye(len(fs), dtype=f.dtype, device=f.device)], [s.leaf for s in self.stores])
        out = f.new_zeros(len(fs), NUM_COMPONENTS)
        for store, g in zip(self.stores, grads):
            out += store.variances(g)
        return out
