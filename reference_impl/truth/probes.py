"""Variance proxies of every output at once, by forward-mode random probes: the truth at workload scale.

The rounding model (reference_impl/truth/golden.py) gives an engine's deviation of a quantity ``f`` as, to first order,
``d = sum_i s_i e_i`` over its rounding errors ``|e_i| <= u_i c_i`` (independent, mean zero), so ``d`` is
sub-Gaussian with variance proxy ``V = sum_i (s_i u_i c_i)^2`` (Hoeffding). :mod:`reference_impl.truth.engine`
computes ``V`` exactly with one batched backward per output: ``F`` outputs of a ``T``-token sequence cost ``F``
backward passes, ``O(F T)``, which rules out judging every position of long prompts.

Here every store gets a random *tangent* instead: ``u_i c_i g_i`` with ``g_i`` independent standard normal (one
variable per element; the rounded BF16 weight is one variable per weight element shared by the sequence's tokens,
``x (u |W| o G)^T``; an AWQ input one per input element). One forward-mode pass (``torch.autograd.forward_ad``)
carries them to every output at once: ``Z_f = sum_i s_i u_i c_i g_i``, exactly ``N(0, V_f)`` for every ``f``
whatever the sensitivities (a linear combination of independent Gaussians). ``K`` probes (``K`` replicas of the
sequence in one batch, each with its own draws) give ``V_hat = mean_k Z_fk^2`` with ``K V_hat / V ~ chi^2_K``.

**The bound** (:func:`probe_lambda`). A correct engine fails the check ``|d| <= LAMBDA_K sqrt(V_hat)`` with
probability ``P = E[P(|d| > LAMBDA_K sqrt(V_hat) | V_hat)] <= E[2 exp(-LAMBDA_K^2 V_hat / (2 V))]``
(Hoeffding, the probes independent of the engine's roundings) ``= 2 E[exp(-(LAMBDA_K^2 / 2K) X)]`` with
``X ~ chi^2_K``, whose moment generating function gives ``P <= 2 (1 + LAMBDA_K^2 / K)^(-K/2)``. Setting that to
the exact bound's risk ``2 exp(-LAMBDA^2 / 2)`` (``LAMBDA`` = 6: 3.0e-8 per quantity) gives
``LAMBDA_K^2 = K (exp(LAMBDA^2 / K) - 1)``: for ``K`` = 64, ``LAMBDA_K`` = 6.95 (the bound 16 % wider than with the
exact ``V`` at the same risk), 32: 8.16, 128: 6.45. Components with different units (BF16 ``2^-8``, fp32
accumulation ``2^-23``, the TPn partial sums) are one Gaussian per element with the summed variance, so ``V`` is
the quantity under the exact bound's square root. The estimate is unbiased (``E[V_hat] = V``);
tests/reference/test_truth_probes.py checks ``K V_hat / V`` against ``chi^2_K`` with the exact ``V`` of the fixtures.

**Cost.** One forward of ``K`` replicas with tangents (about three forwards' arithmetic each: primal, tangent,
the weight term), independent of how many outputs are judged: every position's logprob, every gap, every
routing decision of the sequence.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.autograd.forward_ad as fwAD

from reference_impl.truth import instrument
from reference_impl.truth.instrument import Recorder, RouteDecision, recording, slot
from reference_impl.truth.stores import TP_SIZES, U_ACCUM, U_BF16, covering_tp, error_weights

#: probes per sequence: the bound is 16 % wider than with the exact variance (module docstring)
DEFAULT_PROBES = 64
#: a probed pass's arithmetic: ``fp64`` (every value and estimate), or ``fp32`` (dense models: the values from an
#: fp64 forward, the variance estimates from an fp32 pass with TF32 GEMMs on CUDA; docs/truth.md measures the
#: change of the estimates)
PRECISIONS = ("fp64", "fp32")
#: the fp32 passes' tangent GEMMs (the linears', the weight draws', the LM head's): BF16 inputs with fp32
#: accumulation (docs/truth.md: what that changes, measured against fp64 from the same draws); None: fp32/TF32
TANGENT_GEMM: torch.dtype | None = torch.bfloat16
#: weight-rounding draws made at once (fp64 elements: 2 GiB): a large model's replicas are drawn in groups
WEIGHT_DRAW_ELEMENTS = 1 << 28


def probe_lambda(probes: int, base_lambda: float) -> float:
    """``LAMBDA_K``: the multiplier of ``sqrt(V_hat)`` from ``probes`` probes with the false-failure risk of
    ``base_lambda`` times the exact ``sqrt(V)`` (module docstring; the judges pass conformance/server/bounds.py's
    GOLDEN_LAMBDA, so both bounds share one risk)."""
    if probes < 1:
        raise ValueError(f"at least one probe, got {probes}")
    return math.sqrt(probes * math.expm1(base_lambda ** 2 / probes))


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
        #: the dtype of the tangents' GEMMs (None: the primal's); see :data:`TANGENT_GEMM`
        self.gemm_dtype: torch.dtype | None = None

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
            batched = k > 1 and primal.dim() >= 3 and primal.shape[0] == rows
            shared = batched and kind.startswith("linear") and len(info) == 2
            if batched:
                one = primal[::k]
                info = _every_kth(info, k, rows)
            else:
                one = primal
            sq, operands = error_weights(kind, one, info, n, reduced, (self.tp,))
            var = U_BF16 ** 2 * sq[0]
            if sq[1] is not None:
                var = var + U_ACCUM ** 2 * sq[1].reshape(one.shape)
            if self.tp > 1 and sq[2 + TP_SIZES.index(self.tp)] is not None:
                var = var + U_BF16 ** 2 * sq[2 + TP_SIZES.index(self.tp)].reshape(one.shape)
            std = var.sqrt()
            noise = self._randn(primal.shape, primal)
            if batched:  # [S, ...] against [S * K, ...]
                noise = noise.view(one.shape[0], k, *one.shape[1:]).mul_(std[:, None]).view(primal.shape)
            else:
                noise.mul_(std)
            if operands is not None:
                noise.add_(self._weight_tangent(operands, info, shared).reshape(primal.shape))
            if upstream is not None:
                noise.add_(upstream)
        # make_dual lays the tangent out like the primal: an expanded primal (the rotary tables) needs its own memory
        return fwAD.make_dual(primal if primal.is_contiguous() else primal.contiguous(), noise)

    def _weight_tangent(self, operands, info, shared: bool) -> torch.Tensor:
        """The BF16 weight rounding (one variable per weight element per replica, shared by its tokens) and the
        AWQ input rounding (one per input element). ``shared``: the operands are replica 0's (a dense linear:
        every replica's input is the same); else rows of every replica, ``info[2]`` their flat positions."""
        x, w_abs, w_awq = operands  # x signed: the rounded weight's effect on y_tn is x_tk dW_nk
        k = self.replicas
        group = max(1, min(k, WEIGHT_DRAW_ELEMENTS // w_abs.numel()))  # replicas whose weight draws are made at once
        if shared:  # x: [S * T, K_in], replica 0 of each sequence
            x3 = x.reshape(self.sequences, self.tokens, -1)
            low = self.gemm_dtype or x.dtype
            xl, sigma = x3.to(low), (U_BF16 * w_abs).to(low)
            out = torch.cat([torch.einsum("stc,knc->sktn", xl, self._draw((min(group, k - lo), *w_abs.shape), w_abs, low)
                                          .mul_(sigma)).to(x.dtype) for lo in range(0, k, group)], dim=1)  # [S, K, T, N]
            if w_awq is not None:  # the AWQ input x * pre_quant_scale rounded: one variable per element
                out = out + (U_BF16 * x3.abs()[:, None] * self._randn((self.sequences, k, *x3.shape[1:]), x3)) @ w_awq.T
            return out
        rows = info[2] if len(info) > 2 else torch.arange(x.shape[0], device=x.device)
        batch = torch.div(rows, self.tokens, rounding_mode="floor")  # sequence * K + replica
        seq, replica = torch.div(batch, k, rounding_mode="floor"), batch % k
        out = x.new_zeros(x.shape[0], w_abs.shape[0])
        for lo in range(0, k, group):
            hi = min(k, lo + group)
            stacked = self._randn((hi - lo, *w_abs.shape), w_abs).mul_(U_BF16 * w_abs).transpose(1, 2)  # [g, K_in, N]
            for s_ in seq.unique().tolist():
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


def _joined(parts: list[Probed]) -> Probed:
    """One sequence's probes from passes over groups of its replicas (the same primal in each): the variance
    estimates are means of squares, so the groups' are averaged by their sizes."""
    k = sum(p.probes for p in parts)

    def mean(values):
        return sum(v * p.probes for v, p in zip(values, parts)) / k
    first = parts[0]
    routes = [(d, gaps, mean([p.routes[n][2] for p in parts])) for n, (d, gaps, _) in enumerate(first.routes)]
    return Probed(first.logprob, mean([p.logprob_var for p in parts]), first.best, first.gap,
                  mean([p.gap_var for p in parts]), k, routes)


#: batch rows (sequences x replicas x tokens) of one probed pass at most: 65536 on the fixtures; larger models
#: take fewer (:func:`rows_budget`)
MAX_ROWS = 1 << 16
#: fp64 bytes one activation of a probed pass may take (its primal; the tangent, draws and error weights beside
#: it make a pass's peak several times this: 29 GiB on an H100 for the 8B shape at 16384 rows)
ACTIVATION_BYTES = 2 << 30


def rows_budget(cfg, dtype: torch.dtype = torch.float64) -> int:
    """Rows of one probed pass: MAX_ROWS, fewer where the widest activation (the MLP's) would exceed
    ACTIVATION_BYTES."""
    width = max(cfg.hidden_size, cfg.intermediate_size or 0, (cfg.moe_intermediate_size or 0) * max(1, cfg.top_k or 1))
    return max(1, min(MAX_ROWS, ACTIVATION_BYTES // (dtype.itemsize * width)))


def probe_sequences(truth, seqs: list[list[int]], targets: list[list[int]], probes: int = DEFAULT_PROBES, tp: int = 1,
                    seed: int = 0, max_rows: int | None = None, precision: str = "fp64") -> list[Probed]:
    """Forward-mode probes of each sequence through ``truth`` (a :class:`reference_impl.truth.engine.TruthModel`),
    judged against ``targets`` (one token per position): sequences of equal length share a pass (at most
    ``max_rows`` rows), the layers one at a time (weights streamed once per pass), ``probes`` replicas of each.
    The draws depend on ``seed`` and the batching. ``precision``: :data:`PRECISIONS`."""
    if precision not in PRECISIONS:
        raise ValueError(f"probe precision {precision!r}: one of {', '.join(PRECISIONS)}")
    if precision != "fp64" and truth.cfg.top_k:
        raise ValueError(f"probe precision {precision!r} is for dense models (an fp32 pass may route a near-tie "
                         f"otherwise than the fp64 values it estimates for); this one routes: use fp64")
    if precision != "fp64":
        with _fast_fp32(truth.device):
            return _probe_sequences(truth, seqs, targets, probes, tp, seed, max_rows, torch.float32)
    return _probe_sequences(truth, seqs, targets, probes, tp, seed, max_rows, torch.float64)


def _probe_sequences(truth, seqs, targets, probes, tp, seed, max_rows, dtype) -> list[Probed]:
    max_rows = max_rows or rows_budget(truth.cfg, dtype)
    out: list[Probed | None] = [None] * len(seqs)
    by_length: dict[int, list[int]] = {}
    for i, s in enumerate(seqs):
        by_length.setdefault(len(s), []).append(i)
    for t, idx in sorted(by_length.items()):
        group = max(1, min(probes, max_rows // t))  # replicas per pass
        if group < probes:  # a long sequence: its replicas in groups, independent draws each (seeded apart)
            for i in idx:
                values = _values(truth, [seqs[i]], [targets[i]]) if dtype != torch.float64 else None
                parts = [_probe_pass(truth, [seqs[i]], [targets[i]], min(group, probes - lo), tp,
                                     seed + 7919 * (lo // group + 1), dtype, values)[0]
                         for lo in range(0, probes, group)]
                out[i] = _joined(parts)
            continue
        per = max(1, max_rows // (probes * t))
        for lo in range(0, len(idx), per):
            part = idx[lo:lo + per]
            s_, t_ = [seqs[i] for i in part], [targets[i] for i in part]
            values = _values(truth, s_, t_) if dtype != torch.float64 else None
            for i, p in zip(part, _probe_pass(truth, s_, t_, probes, tp, seed, dtype, values)):
                out[i] = p
    return out



def probe_sequence(truth, ids: list[int], targets: list[int], probes: int = DEFAULT_PROBES, tp: int = 1,
                   seed: int = 0) -> Probed:
    return probe_sequences(truth, [ids], [targets], probes, tp, seed)[0]


#: elements of one LM-head chunk's logits over the replicas (fp64: 1 GiB): a 128k vocabulary takes a few rows
HEAD_ELEMENTS = 1 << 27


def _probe_pass(truth, seqs: list[list[int]], targets: list[list[int]], probes: int, tp: int, seed: int,
                dtype: torch.dtype = torch.float64, values: list[tuple] | None = None) -> list[Probed]:
    """One probed pass over ``seqs`` (all of one length), ``probes`` replicas each, in ``dtype``. ``values``: each
    sequence's ``(logprob, best, gap)`` from an fp64 forward (:func:`_values`), replacing the pass's own (an
    fp32 pass gives the variance estimates only)."""
    gen = torch.Generator(device=truth.device).manual_seed(seed)
    n, t = len(seqs), len(seqs[0])
    probe = Probe(probes, t, tp, gen, sequences=n)
    if dtype != torch.float64:
        probe.gemm_dtype = TANGENT_GEMM
    routes: list[RouteDecision] = []
    with fwAD.dual_level(), torch.no_grad():
        x = torch.cat([truth.embed(ids).to(dtype).expand(probes, t, -1) for ids in seqs]).contiguous()
        x = fwAD.make_dual(x, torch.zeros_like(x))
        pe = truth._positions(x)
        for i in range(truth.cfg.num_layers):
            with _layer(truth, i, dtype) as layer:
                share_primal(layer, probe)
                rec = Recorder(truth.cfg, False, {}, i, probe=probe)
                with recording(rec):
                    x = truth._run(layer, x, pe)
                routes += rec.routes
        with recording(Recorder(truth.cfg, False, probe=probe)):
            h = truth.final_norm(x).to(dtype)
        del x
        w = truth.lm_head().to(dtype)
        out = [_head(truth, h[s * probes:(s + 1) * probes], w, targets[s], tp, gen,
                     None if values is None else values[s], probe.gemm_dtype) for s in range(n)]
        for d in routes:
            gp, gt = fwAD.unpack_dual(d.gaps)
            gt = gt if gt is not None else torch.zeros_like(gp)
            gp, gt = gp.reshape(n, probes, t), gt.reshape(n, probes, t)
            for s in range(n):
                out[s].routes.append((d, gp[s, 0].cpu(), gt[s].pow(2).mean(0).cpu()))
    return out


@contextlib.contextmanager
def keeping_layers(truth, dtype: torch.dtype = torch.float32, budget_bytes: int | None = None):
    """Probed passes in ``dtype`` inside this context reuse each decoder layer built once (its weights decoded
    and cast once, not at every pass) while their parameters fit ``budget_bytes`` (default: a quarter of the
    truth device's memory, 2 GiB on a CPU); freed on exit. A workload's truth makes hundreds of passes."""
    if budget_bytes is None:
        budget_bytes = (torch.cuda.get_device_properties(truth.device).total_memory // 4
                        if truth.device.type == "cuda" else 2 << 30)
    truth._probe_layers = {"dtype": dtype, "budget": budget_bytes, "bytes": 0, "layers": {}}
    try:
        yield
    finally:
        truth._probe_layers = None


@contextlib.contextmanager
def _layer(truth, i: int, dtype: torch.dtype):
    """Decoder layer ``i`` in ``dtype``: kept by :func:`keeping_layers` if one is open for ``dtype``."""
    keep = getattr(truth, "_probe_layers", None)
    if keep is not None and keep["dtype"] == dtype and i in keep["layers"]:
        yield keep["layers"][i]
        return
    with truth.layer(i) as layer:
        if dtype != torch.float64:  # (DeepSeek's router stays fp32 in fp64 mode, as transformers has it)
            layer.to(dtype)
        if keep is not None and keep["dtype"] == dtype:
            size = sum(p.numel() * p.element_size() for p in layer.parameters())
            if keep["bytes"] + size <= keep["budget"]:
                keep["layers"][i] = layer
                keep["bytes"] += size
        yield layer


def share_primal(layer: torch.nn.Module, probe: Probe) -> None:
    """Every ``nn.Linear`` of ``layer`` computes its output's primal once per sequence (replica 0's rows, copied
    to the others: the replicas' primal is one) and only the tangent per replica: the replicated primal GEMM
    was a third of a probed pass's arithmetic. The result is what ``F.linear`` of the dual gives."""
    for mod in layer.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.forward = _SharedPrimalLinear(mod, probe)


class _SharedPrimalLinear:
    # holds the module's tensors, not the module: a module -> forward -> module cycle would keep every layer's
    # weights alive until Python's cyclic collector happened to run (out of GPU memory within minutes)
    def __init__(self, mod: torch.nn.Linear, probe: Probe):
        self.weight, self.bias, self.probe = mod.weight, mod.bias, probe

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        p, tangent = fwAD.unpack_dual(x)
        k, rows = self.probe.replicas, self.probe.replicas * self.probe.sequences
        if tangent is None or k == 1 or p.dim() < 3 or p.shape[0] != rows:
            return torch.nn.functional.linear(x, w, b)
        one = torch.nn.functional.linear(p[::k], w, b)  # [S, T, N]
        primal_out = one.repeat_interleave(k, dim=0)  # sequence s, replica r at s * k + r
        return fwAD.make_dual(primal_out, _tangent_gemm(tangent, w, self.probe.gemm_dtype))


def _tangent_gemm(tangent: torch.Tensor, w: torch.Tensor, low: torch.dtype | None) -> torch.Tensor:
    """``tangent @ w.T`` in the tangent's dtype, or in ``low`` (fp32 accumulation) and back."""
    if low is None or low == tangent.dtype:
        return torch.nn.functional.linear(tangent, w)
    return torch.nn.functional.linear(tangent.to(low), w.to(low)).to(tangent.dtype)


def _values(truth, seqs: list[list[int]], targets: list[list[int]]) -> list[tuple]:
    """``(logprob, best, gap)`` per row of each sequence (all of one length) from the fp64 forward (values only:
    no probes), for an fp32 probed pass."""
    with torch.no_grad():
        x = torch.cat([truth.embed(ids) for ids in seqs])
        pe = truth._positions(x)
        for i in range(truth.cfg.num_layers):
            with truth.layer(i) as layer, recording(Recorder(truth.cfg, False, {}, i)):
                x = truth._run(layer, x, pe)
        h = truth.final_norm(x)
        w = truth.lm_head()
        out = []
        for s, tg in enumerate(targets):
            tg = torch.tensor(tg, device=w.device)
            rows = max(1, HEAD_ELEMENTS // w.shape[0])
            parts = []
            for lo in range(0, h.shape[1], rows):
                logits = h[s, lo:lo + rows] @ w.T
                c = tg[lo:lo + rows, None]
                best = logits.argmax(-1)
                parts.append((logits.gather(1, c)[:, 0] - torch.logsumexp(logits, -1), best,
                              logits.gather(1, best[:, None])[:, 0] - logits.gather(1, c)[:, 0]))
            out.append(tuple(torch.cat([p[i] for p in parts]) for i in range(3)))
    return out


@contextlib.contextmanager
def _fast_fp32(device: torch.device):
    """fp32 GEMMs in TF32 on CUDA (the fp32 probes' arithmetic; docs/truth.md gives the estimates' measured
    change); restored after."""
    if device.type != "cuda":
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _head(truth, h: torch.Tensor, w: torch.Tensor, targets: list[int], tp: int, gen, values=None,
          gemm_dtype: torch.dtype | None = None) -> Probed:
    """The LM head (a BF16 ``dot`` store) of one sequence's replicas ``h [K, T, H]`` (dual), in chunks of rows,
    reduced at once to the per-row statistics against ``targets``. ``values``: the rows' ``(logprob, best, gap)``
    from the fp64 forward (the gap's estimate is then taken for that best token)."""
    k, t, width = h.shape
    rows = max(1, HEAD_ELEMENTS // (k * w.shape[0]))
    tg = torch.tensor(targets, device=w.device)
    parts = []
    h_primal, h_tangent = fwAD.unpack_dual(h)
    for lo in range(0, t, rows):
        hp, ht = h_primal[:1, lo:lo + rows], h_tangent[:, lo:lo + rows]
        c = hp.shape[1]
        p0 = (hp @ w.T)[0]                                  # the replicas' primal is one: computed once
        # the linearised head by hand (the tangent through the product, then the store's own draws)
        store = Probe(k, c, tp, gen).perturb("dot", p0.expand(k, c, -1), lambda: hp.abs() @ w.abs().T, width, False)
        z = fwAD.unpack_dual(store).tangent + _tangent_gemm(ht, w, gemm_dtype)
        tc = tg[lo:lo + c]
        dz = z.gather(2, tc.expand(k, -1)[..., None])[..., 0] - (z * torch.softmax(p0, -1)).sum(-1)
        if values is None:
            lp = p0.gather(1, tc[:, None])[:, 0] - torch.logsumexp(p0, -1)
            best = p0.argmax(-1)
            gap = p0.gather(1, best[:, None])[:, 0] - p0.gather(1, tc[:, None])[:, 0]
        else:
            lp, best, gap = (v[lo:lo + c] for v in values)
        dg = z.gather(2, best.expand(k, -1)[..., None])[..., 0] - z.gather(2, tc.expand(k, -1)[..., None])[..., 0]
        parts.append((lp, dz.pow(2).mean(0), best, gap, dg.pow(2).mean(0)))
        del store, z
    cat = [torch.cat([p[i] for p in parts]).cpu() for i in range(5)]
    if values is not None:  # the estimates in fp64 beside fp64 values
        cat = [c.double() if c.is_floating_point() else c for c in cat]
    return Probed(cat[0], cat[1], cat[2], cat[3], cat[4], k)


def route_outputs(cfg, probed: Probed) -> list[tuple[int, int, float, float]]:
    """Every finite routing decision: ``(position, slot, gap, V_hat)``."""
    out = []
    for d, gaps, var in probed.routes:
        s = slot(cfg, d.layer, d.kind)
        for pos in torch.isfinite(gaps).nonzero()[:, 0].tolist():
            out.append((pos, s, float(gaps[pos]), float(var[pos])))
    return out
