"""The per-store random tangents of the probes (:class:`Probe`) and the per-sequence result (:class:`Probed`):
what :mod:`reference_impl.truth.probes` derives, drawn. ``Probe.perturb`` is the
:class:`reference_impl.truth.instrument.Recorder`'s hook for every store of a probed pass."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.autograd.forward_ad as fwAD

from reference_impl.truth import instrument, store_kernel
from reference_impl.truth.stores import TP_SIZES, U_BF16, covering_tp, store_std

#: weight-rounding draws made at once (fp64 elements: 2 GiB): a large model's replicas are drawn in groups
WEIGHT_DRAW_ELEMENTS = 1 << 28


def _every_kth(info, k: int, rows: int):
    """``info``'s activations laid out like the store (``[rows, tokens, ...]``) taken at replica 0 of each sequence
    (a weight ``[N, K]`` whose N happens to equal ``rows`` is left alone)."""
    if isinstance(info, torch.Tensor):
        return info[::k] if info.dim() >= 3 and info.shape[0] == rows else info  # not a weight matrix
    if isinstance(info, (tuple, list)):
        return type(info)(_every_kth(x, k, rows) for x in info)
    return info


class Probe:
    """Gives each store of a forward over ``replicas`` copies of each of ``sequences`` ``tokens``-token sequences
    its random tangent (a :class:`reference_impl.truth.instrument.Recorder`'s ``probe``). ``tp``: the
    tensor-parallel size whose partial-sum roundings are included (1: none). Replica ``k`` of every sequence
    shares its weight-rounding draws: each sequence's estimates are still exactly as described (a quantity
    depends on its own sequence only), and the draws, the dearest part of a short sequence, are made once."""

    def __init__(self, replicas: int, tokens: int, tp: int = 1, generator: torch.Generator | None = None,
                 sequences: int = 1):
        if tp > 1:
            covering = covering_tp(tp)
            if covering is None:
                raise ValueError(f"probes cover tensor parallelism up to {TP_SIZES[-1]}, got {tp}")
            tp = covering
        self.replicas, self.tokens, self.tp = replicas, tokens, tp
        self.sequences = sequences  # batch rows: sequence s, replica k at s * replicas + k
        self.generator = generator
        #: the dtype of the tangents' GEMMs (None: the primal's); see :data:`reference_impl.truth.probe_pass.TANGENT_GEMM`
        self.gemm_dtype: torch.dtype | None = None
        #: the CUDA kernels' Philox keys (store_kernel.py, attention_kernel.py): drawn once, counted up
        self.keys = store_kernel.Keys(generator)

    def replicated(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is laid out ``[sequences x replicas, ...]`` (sequence s, replica k at ``s * replicas +
        k``), the replicas of a sequence sharing one primal; not so for one replica."""
        return self.replicas > 1 and x.dim() >= 3 and x.shape[0] == self.replicas * self.sequences

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A replicated dual ``x`` (:meth:`replicated`) as each sequence's primal ``[sequences, ...]`` (replica
        0's rows, detached) and the replicas' tangent ``[sequences x replicas, ...]`` (None where it has none)."""
        p, t = fwAD.unpack_dual(x)
        return p.detach()[::self.replicas], t

    def join(self, one: torch.Tensor, tangent: torch.Tensor) -> torch.Tensor:
        """The dual of :meth:`split`: each sequence's primal ``one`` copied to its replicas, with ``tangent``."""
        return fwAD.make_dual(one.repeat_interleave(self.replicas, dim=0), tangent)

    def _randn(self, shape, like: torch.Tensor) -> torch.Tensor:
        # float32 normals (3x faster to draw than fp64): their quantization (2^-24 relative) and Box-Muller's
        # float32 tail (|g| < 5.8) move the variance by < 1e-6 relative, nothing against the chi^2 spread
        g = torch.randn(shape, dtype=torch.float32, generator=self.generator, device=like.device)
        return g.to(like.dtype)

    def _draw(self, shape, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Standard normals in ``dtype`` (BF16 draws for BF16 GEMMs: their quantization, 2^-9 relative, moves
        the variance by < 1e-5)."""
        if dtype == torch.bfloat16:
            return torch.randn(shape, dtype=dtype, generator=self.generator, device=like.device)
        return self._randn(shape, like.to(dtype) if like.dtype != dtype else like)

    def perturb(self, kind: str, value: torch.Tensor, info, n: int, reduced: bool) -> torch.Tensor:
        primal, upstream = fwAD.unpack_dual(value)
        primal = primal.detach()
        k, rows = self.replicas, self.replicas * self.sequences
        with torch.no_grad():
            info = instrument.primal(info() if callable(info) else info)
            # a store laid out [sequence x replica, ...] has the same primal in every replica of a sequence: its
            # error weights from replica 0 (for a dense linear the accumulation term is a GEMM as large as the
            # linear); the MoE experts' and router's rows mix sequences, replicas and tokens: all of them
            batched = self.replicated(primal)
            shared = batched and kind.startswith("linear") and len(info) == 2
            one, info = (primal[::k], _every_kth(info, k, rows)) if batched else (primal, info)
            noise = self._tangent(kind, one, upstream, primal.shape, info, n, reduced, batched, shared)
        # make_dual lays the tangent out like the primal: an expanded primal (the rotary tables) needs its own memory
        return fwAD.make_dual(primal if primal.is_contiguous() else primal.contiguous(), noise)

    def store_tangent(self, kind: str, one: torch.Tensor, upstream: torch.Tensor | None, info, n: int,
                      reduced: bool = False, shared: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tangent a store gives its replicas (``[sequences x replicas, ...]``: ``upstream`` plus its own
        draws) from each sequence's primal ``one`` (``[sequences, ...]``) and error weights ``info`` (of ``one``):
        what :meth:`perturb` gives a dual of the replicated primal, for a computation that holds the primal once
        per sequence (the probed attention and MLP). ``shared``: a dense linear's store, ``info`` its replica-0
        operands ``(x, W)`` (its weight term added group by group). ``upstream`` may be in a lower precision than
        ``one`` (a BF16 GEMM's output: promoted as it is read). ``dtype``: the tangent's, where its only reader
        casts it (a store without a weight term; default ``one``'s): rounded once as it is written."""
        shape = (one.shape[0] * self.replicas, *one.shape[1:])
        with torch.no_grad():
            return self._tangent(kind, one, upstream, shape, info, n, reduced, self.replicas > 1,
                                 shared and self.replicas > 1, dtype)

    def softmax_stores(self, scores: torch.Tensor, st: torch.Tensor, info: torch.Tensor, n: int,
                       p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A probed softmax's two stores by :func:`reference_impl.truth.store_kernel.softmax_stores` (CUDA fp32):
        ``st`` (``[S, K, ...]``, each sequence's replicas' tangents of ``scores``, overwritten) through the scores'
        ``dot`` store (``info``, ``n`` as :meth:`store_tangent`'s), times ``p``, then the probabilities' ``round``
        store: ``(that tangent, its sums over the last axis before the second store)``. The same distribution as
        the three eager steps, other draws; None where the kernel does not serve (the caller's eager steps)."""
        if self.replicas < 2 or not store_kernel.softmax_available(scores):
            return None
        with torch.no_grad():
            std, _ = store_std("dot", scores, info, n, False, self.tp)
            round_std, _ = store_std("round", torch.ones((), dtype=p.dtype), None, 0, False, self.tp)
            mean = store_kernel.softmax_stores(st, p, std, float(round_std), self.keys(scores.device))
        return None if mean is None else (st, mean)

    def _tangent(self, kind, one, upstream, shape, info, n, reduced, batched, shared, dtype=None) -> torch.Tensor:
        std, operands = store_std(kind, one, info, n, reduced, self.tp)
        noise = None
        if std.shape == one.shape and store_kernel.available(one, std):
            # the draw and add in one pass (CUDA fp32; same distribution, other numbers); None: eager after all
            noise = store_kernel.try_draw_add(upstream, std, shape[0], dtype or one.dtype, self.keys(one.device))
        if noise is None:
            noise = self._draw_add(one, upstream, std, shape, batched, dtype)
        noise = noise.view(shape)
        if operands is not None:
            self._add_weight_tangent(noise, operands, info, shared)
        return noise

    def _draw_add(self, one, upstream, std, shape, batched, dtype) -> torch.Tensor:
        """``upstream + std z`` eagerly: the normals drawn from the generator, then added."""
        noise = self._randn(shape, one)
        if batched:  # [S, ...] against [S * K, ...]
            std = std[:, None]
            noise = noise.view(one.shape[0], self.replicas, *one.shape[1:])
        if upstream is not None:  # noise * std + upstream in one pass
            out = noise if dtype in (None, noise.dtype) else torch.empty(noise.shape, dtype=dtype, device=noise.device)
            return torch.addcmul(upstream.reshape(noise.shape), noise, std, out=out)
        return noise.mul_(std)

    def _add_weight_tangent(self, noise: torch.Tensor, operands, info, shared: bool) -> None:
        """``noise += `` the weight terms (:meth:`_weight_tangent`); a dense linear's group by group, in place (no
        copy of the ``[S, K, T, N]`` product beyond the GEMM's own)."""
        if not shared:
            noise.add_(self._weight_tangent(operands, info, shared).reshape(noise.shape))
            return
        x, w_abs, w_awq = operands  # x signed: the rounded weight's effect on y_tn is x_tk dW_nk
        k = self.replicas
        group = max(1, min(k, WEIGHT_DRAW_ELEMENTS // w_abs.numel()))  # replicas whose weight draws are made at once
        x3 = x.reshape(self.sequences, self.tokens, -1)  # replica 0 of each sequence: [S, T, K_in]
        low = self.gemm_dtype or x.dtype
        xl, sigma = x3.to(low), (U_BF16 * w_abs).to(low)
        by_replica = noise.view(self.sequences, k, self.tokens, -1)  # [S, K, T, N]
        for lo in range(0, k, group):
            draws = self._draw((min(group, k - lo), *w_abs.shape), w_abs, low).mul_(sigma)
            for j in range(draws.shape[0]):  # [S, T, N] products in the rows' own layout: a coalesced add
                by_replica[:, lo + j] += xl @ draws[j].T
        if w_awq is not None:  # the AWQ input x * pre_quant_scale rounded: one variable per element
            by_replica += (U_BF16 * x3.abs()[:, None] * self._randn((self.sequences, k, *x3.shape[1:]), x3)) @ w_awq.T

    def _weight_tangent(self, operands, info, shared: bool) -> torch.Tensor:
        """The BF16 weight rounding (one variable per weight element per replica, shared by its tokens) and the
        AWQ input rounding (one per input element), for rows of every replica (an MoE expert's: ``info[2]``
        their flat positions); a dense linear's (``shared``: replica 0's operands) are added in place by
        :meth:`_add_weight_tangent`."""
        x, w_abs, w_awq = operands  # x signed: the rounded weight's effect on y_tn is x_tk dW_nk
        k = self.replicas
        group = max(1, min(k, WEIGHT_DRAW_ELEMENTS // w_abs.numel()))  # replicas whose weight draws are made at once
        rows = info[2] if len(info) > 2 else torch.arange(x.shape[0], device=x.device)
        batch = torch.div(rows, self.tokens, rounding_mode="floor")  # sequence * K + replica
        seq, replica = torch.div(batch, k, rounding_mode="floor"), batch % k
        out = x.new_zeros(x.shape[0], w_abs.shape[0])
        pos = rows % self.tokens
        rest = [s_ for s_ in seq.unique().tolist() if not self._few_rows(x, w_abs, seq == s_, replica, pos, out)]
        for lo in range(0, k if rest else 0, group):
            hi = min(k, lo + group)
            stacked = self._randn((hi - lo, *w_abs.shape), w_abs).mul_(U_BF16 * w_abs).transpose(1, 2)  # [g, K_in, N]
            for s_ in rest:
                sel = ((seq == s_) & (replica >= lo) & (replica < hi)).nonzero()[:, 0]
                order = sel[torch.argsort(replica[sel], stable=True)]
                n = len(order) // (hi - lo)
                expected = torch.arange(lo, hi, device=x.device)[:, None]
                if n and n * (hi - lo) == len(order) and bool((replica[order].view(hi - lo, n) == expected).all()):
                    # every replica routes the same tokens here (their primal is the same): one batched product
                    out[order] = torch.bmm(x[order].view(hi - lo, n, -1), stacked).reshape((hi - lo) * n, -1)
                else:
                    for r in range(lo, hi):
                        part = sel[replica[sel] == r]
                        if len(part):
                            out[part] = x[part] @ stacked[r - lo]
        if w_awq is not None:
            out = out + (U_BF16 * x.abs() * self._randn(x.shape, x)) @ w_awq.T
        return out

    def _few_rows(self, x, w_abs, of_seq, replica, pos, out) -> bool:
        """One sequence's weight term from its covariance, where every replica routes the same ``n <= K`` tokens
        here (an MoE expert most sequences reach with a few): column ``j`` of ``x (dW o G)^T`` over those rows is
        exactly ``N(0, C_j)``, ``C_j = X diag(u^2 |W_j|^2) X^T`` (``n x n``), drawn as ``V_j sqrt(L_j) g`` from its
        eigendecomposition: ``K N n`` normals instead of ``K N K_in`` (the whole matrix per replica). Writes
        ``out``'s rows; False where it does not apply (the product then)."""
        k = self.replicas
        sel = of_seq.nonzero()[:, 0]
        order = sel[torch.argsort(replica[sel], stable=True)]
        n = len(order) // k
        if not 0 < n <= k or n * k != len(order):
            return False
        if not bool((replica[order].view(k, n) == torch.arange(k, device=x.device)[:, None]).all()):
            return False
        if not bool((pos[order].view(k, n) == pos[order[:n]]).all()):  # the same tokens in every replica
            return False
        rows = x[order[:n]]  # replica 0's: the replicas' primal is one
        cov = torch.einsum("tc,sc,nc->nts", rows, rows, (U_BF16 * w_abs) ** 2)  # [N, n, n]
        lam, vec = torch.linalg.eigh(cov)
        scale = vec * lam.clamp_min(0).sqrt()[:, None, :]  # cov = scale scale^T (rounding's negatives at 0)
        g = self._randn((k, w_abs.shape[0], n), x)
        out[order] = torch.einsum("nti,kni->ktn", scale, g).reshape(k * n, -1)
        return True


@dataclass
class Probed:
    """One sequence probed against its targets (row ``r``: ``targets[r]``, the token that follows it): per row the
    reference's logprob of the target, its best token, the logit gap ``logit(best) - logit(target)`` (0 where they
    are the same), the variance estimates ``V_hat`` of the logprob and the gap, and every routing decision
    ``(decision, gaps [T], V_hat [T])``."""

    logprob: torch.Tensor
    logprob_var: torch.Tensor
    best: torch.Tensor
    gap: torch.Tensor
    gap_var: torch.Tensor
    probes: int
    routes: list = field(default_factory=list)
