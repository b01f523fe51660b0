"""One probed pass (:func:`run_pass`) through the truth's layers, in fp64 or fp32 (:data:`TANGENT_GEMM`), with
the linears' primal computed once per sequence (:func:`share_primal`), the fp64 values an fp32 pass replaces
(:func:`values_fp64`) and the layers kept between passes (:func:`keeping_layers`); the LM head linearised by
hand. :func:`reference_impl.truth.probes.probe_sequences` drives it."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.autograd.forward_ad as fwAD

from reference_impl.truth.instrument import Recorder, RouteDecision, recording
from reference_impl.truth.probe_draws import Probe, Probed

#: the fp32 passes' tangent GEMMs (the linears', the weight draws', the LM head's): BF16 inputs with fp32
#: accumulation (docs/truth.md: what that changes, measured against fp64 from the same draws); None: fp32/TF32
TANGENT_GEMM: torch.dtype | None = torch.bfloat16
#: elements of one LM-head chunk's logits over the replicas (fp64: 1 GiB): a 128k vocabulary takes a few rows
HEAD_ELEMENTS = 1 << 27


def run_pass(truth, seqs: list[list[int]], targets: list[list[int]], probes: int, tp: int, seed: int,
             dtype: torch.dtype = torch.float64, values: list[tuple] | None = None) -> list[Probed]:
    """One probed pass over ``seqs`` (all of one length), ``probes`` replicas each, in ``dtype``. ``values``: each
    sequence's ``(logprob, best, gap)`` from an fp64 forward (:func:`values_fp64`), replacing the pass's own (an
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
        # the head's weight as its three products read it, made once for every sequence (each is a full pass
        # over the vocabulary's weight: per sequence they cost a short sequence's head several times over)
        weights = (w, w.abs(), w if probe.gemm_dtype is None else w.to(probe.gemm_dtype))
        out = [_head(truth, h[s * probes:(s + 1) * probes], weights, targets[s], tp, gen,
                     None if values is None else values[s], probe.gemm_dtype) for s in range(n)]
        for d in routes:
            gp, gt = fwAD.unpack_dual(d.gaps)
            gt = gt if gt is not None else torch.zeros_like(gp)
            gp, gt = gp.reshape(n, probes, t), gt.reshape(n, probes, t)
            for s in range(n):
                out[s].routes.append((d, gp[s, 0].cpu(), gt[s].pow(2).mean(0).cpu()))
    return out


#: the memory a CPU truth device counts as for :func:`keeping_layers`' share
CPU_MEMORY_BYTES = 8 << 30
#: :func:`keeping_layers`' default share of the truth device's memory for the kept layers (benchmarks/
#: bench_truth.py and bench_probe_pass.py ``--keep-share`` set it)
KEEP_SHARE = 0.25


@dataclass
class KeptLayers:
    """Decoder layers built in ``dtype`` and kept between passes, within ``budget`` bytes of parameters."""

    dtype: torch.dtype
    budget: int
    used: int = 0
    layers: dict = field(default_factory=dict)


@contextlib.contextmanager
def keeping_layers(*truths, dtype: torch.dtype = torch.float32, share: float | None = None):
    """Probed passes in ``dtype`` inside this context reuse each decoder layer of each of ``truths`` built once (its
    weights decoded and cast once, not at every pass) while their parameters fit ``share`` of its truth device's
    memory (a CPU counts as :data:`CPU_MEMORY_BYTES`; None: :data:`KEEP_SHARE`); freed on exit. A workload's
    truth makes hundreds of passes."""
    share = KEEP_SHARE if share is None else share
    unique = list({id(t): t for t in truths}.values())
    for t in unique:
        memory = (torch.cuda.get_device_properties(t.device).total_memory if t.device.type == "cuda"
                  else CPU_MEMORY_BYTES)
        t._probe_layers = KeptLayers(dtype, int(share * memory))
    try:
        yield
    finally:
        for t in unique:
            t._probe_layers = None


@contextlib.contextmanager
def _layer(truth, i: int, dtype: torch.dtype):
    """Decoder layer ``i`` in ``dtype``: kept by :func:`keeping_layers` if one is open for ``dtype``."""
    keep = getattr(truth, "_probe_layers", None)
    keep = keep if keep is not None and keep.dtype == dtype else None
    if keep is not None and i in keep.layers:
        yield keep.layers[i]
        return
    with truth.layer(i) as layer:
        if dtype != torch.float64:  # (DeepSeek's router stays fp32 in fp64 mode, as transformers has it)
            layer.to(dtype)
        if keep is not None:
            size = sum(p.numel() * p.element_size() for p in layer.parameters())
            if keep.used + size <= keep.budget:
                keep.layers[i] = layer
                keep.used += size
        yield layer


def share_primal(layer: torch.nn.Module, probe: Probe) -> None:
    """Every ``nn.Linear`` of ``layer`` computes its output's primal once per sequence (replica 0's rows, copied
    to the others: the replicas' primal is one) and only the tangent per replica: the replicated primal GEMM
    was a third of a probed pass's arithmetic. The result is what ``F.linear`` of the dual gives. A dense MLP
    ``down(silu(gate(x)) * up(x))`` runs by hand (:class:`_ProbedMLP`)."""
    for mod in layer.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.forward = _SharedPrimalLinear(mod, probe)
        elif _plain(type(mod), RMS_NORM):  # q_norm / k_norm too (Qwen3)
            mod.forward = _ProbedNorm(mod.weight, mod.variance_epsilon, probe)
    mlp = getattr(layer, "mlp", None)
    if mlp is None:
        return
    # by hand where the rows are replicas (a pass of one replica, a long sequence's last group, has no primal to
    # share: forward_ad and the hooks, as the attention then); a kept layer may hold an earlier pass's
    mlp.__dict__.pop("forward", None)
    if probe.replicas > 1 and _plain_mlp(type(mlp)) and type(getattr(mlp, "act_fn", None)).__name__ in SILU:
        mlp.forward = _ProbedMLP(mlp.gate_proj, mlp.up_proj, mlp.down_proj, probe)


#: transformers' SiLU activation classes (ACT2FN["silu"])
SILU = ("SiLUActivation", "SiLU")
#: the forward bodies (whitespace removed) run by hand: transformers' dense MLPs, its RMSNorms
DENSE_MLP = ("returnself.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))",
             "down_proj=self.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))returndown_proj")
RMS_NORM = ("input_dtype=hidden_states.dtypehidden_states=hidden_states.to(torch.float32)variance=hidden_states."
            "pow(2).mean(-1,keepdim=True)hidden_states=hidden_states*torch.rsqrt(variance+self.variance_epsilon)"
            "returnself.weight*hidden_states.to(input_dtype)",)
_PLAIN: dict[tuple[type, tuple], bool] = {}


def _plain(cls: type, bodies: tuple[str, ...]) -> bool:
    """Whether ``cls.forward`` computes exactly one of ``bodies`` (read from its source once per class: a changed
    class runs through forward_ad, not by hand)."""
    if (cls, bodies) not in _PLAIN:
        import inspect

        try:
            src = "".join(inspect.getsource(cls.forward).split())
        except (OSError, TypeError):
            src = ""
        _PLAIN[(cls, bodies)] = any(b in src for b in bodies)
    return _PLAIN[(cls, bodies)]


def _plain_mlp(cls: type) -> bool:
    """Whether ``cls`` is a dense MLP ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (:data:`DENSE_MLP`)."""
    return _plain(cls, DENSE_MLP)


class _ProbedNorm:
    """An RMSNorm under probes, by hand where its rows are replicas: transformers' primal once per sequence, each
    replica's tangent ``w r (t - x r^2 mean(x t))`` (``r = rsqrt(mean(x^2) + eps)``: forward-mode's, in the
    pass's dtype). Its store stays the hook's. forward_ad would compute the norm once per replica. Holds tensors,
    not the module (see :class:`_SharedPrimalLinear`)."""

    def __init__(self, weight: torch.Tensor, eps: float, probe: Probe):
        self.weight, self.eps, self.probe = weight, eps, probe

    def _primal(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # transformers' own arithmetic, and r
        h = x.to(torch.float32)
        r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (h * r).to(x.dtype), r

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x1, t = self.probe.split(x)
        if t is None or not self.probe.replicated(x):
            return self._primal(x)[0]  # forward_ad through the same operations
        k = self.probe.replicas
        with torch.no_grad():
            y1, r = self._primal(x1)
            r = r.to(x1.dtype)
            each = t.view(x1.shape[0], k, *x1.shape[1:])
            m = (each * x1[:, None]).mean(-1, keepdim=True)  # mean(x t) per replica
            yt = each * (self.weight * r)[:, None]
            yt.addcmul_((self.weight * x1 * r.pow(3))[:, None], m, value=-1)
        return self.probe.join(y1, yt.view(t.shape))


class _ProbedMLP:
    """A dense MLP under probes, by hand: the primal once per sequence (gate, up, ``silu(gate) * up``, down), each
    replica's tangent by forward-mode's rules, and the four stores the hooks would make (the linears' with their
    weight terms, the ``act``), with the same draws in the same order
    (:meth:`reference_impl.truth.probe_draws.Probe.store_tangent`). forward_ad would run the ``silu`` and the
    product on a primal replicated per probe. Holds tensors, not modules (see :class:`_SharedPrimalLinear`)."""

    def __init__(self, gate, up, down, probe: Probe):
        self.linears = [(m.weight, m.bias, m._truth_store) for m in (gate, up, down)]
        self.probe = probe

    def _linear(self, i: int, x1: torch.Tensor, xt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w, b, (kind, reduced) = self.linears[i]
        out = torch.nn.functional.linear(x1, w, b)
        t = _tangent_gemm(xt, w, self.probe.gemm_dtype, cast_back=False)  # the store reads it as it is
        return out, self.probe.store_tangent(kind, out, t, (x1, w), x1.shape[-1], reduced, shared=True)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        k = self.probe.replicas
        x1, xt = self.probe.split(x)
        if xt is None or not self.probe.replicated(x):
            raise RuntimeError("the probed MLP runs on a probed pass's replicated rows only")
        g1, gt = self._linear(0, x1, xt)
        u1, ut = self._linear(1, x1, xt)
        with torch.no_grad():
            a1 = torch.nn.functional.silu(g1)
            h1 = a1 * u1
            slope = torch.ops.aten.silu_backward(torch.ones_like(g1), g1)  # d silu / d g
            s, rest = g1.shape[0], g1.shape[1:]
            ht = (gt.view(s, k, *rest) * (slope * u1)[:, None]).addcmul_(ut.view(s, k, *rest), a1[:, None])
            # its only reader is the down GEMM: written in that GEMM's dtype (the same rounding, one pass fewer)
            ht = self.probe.store_tangent("act", h1, ht.view(s * k, *rest), None, 0, dtype=self.probe.gemm_dtype)
        y1, yt = self._linear(2, h1, ht)
        return self.probe.join(y1, yt)


class _SharedPrimalLinear:
    # holds the module's tensors, not the module: a module -> forward -> module cycle would keep every layer's
    # weights alive until Python's cyclic collector happened to run (out of GPU memory within minutes)
    def __init__(self, mod: torch.nn.Linear, probe: Probe):
        self.weight, self.bias, self.probe = mod.weight, mod.bias, probe

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        x1, tangent = self.probe.split(x)
        if tangent is None or not self.probe.replicated(x):
            return torch.nn.functional.linear(x, w, b)
        one = torch.nn.functional.linear(x1, w, b)  # [S, T, N]
        return self.probe.join(one, _tangent_gemm(tangent, w, self.probe.gemm_dtype))


def _tangent_gemm(tangent: torch.Tensor, w: torch.Tensor, low: torch.dtype | None,
                  cast_back: bool = True) -> torch.Tensor:
    """``tangent @ w.T`` in the tangent's dtype, or in ``low`` (fp32 accumulation) and back to the primal's
    (``cast_back``; else left in ``low``)."""
    if low is None:
        return torch.nn.functional.linear(tangent, w)
    out = torch.nn.functional.linear(tangent.to(low), w.to(low))
    return out.to(w.dtype) if cast_back else out


def values_fp64(truth, batches: list[tuple[list[list[int]], list[list[int]]]]) -> list[list[tuple]]:
    """``(logprob, best, gap)`` per row of each sequence from the fp64 forward (values only: no probes), for an
    fp32 probed pass. ``batches``: ``(sequences, targets)``, the sequences of a batch all of one length; every
    batch goes through a layer while it is decoded (one sweep of the weights for all of them: a layer's fp64
    decoding costs as much as a short batch's forward)."""
    with torch.no_grad():
        xs = [torch.cat([truth.embed(ids) for ids in seqs]) for seqs, _ in batches]
        pes = [truth._positions(x) for x in xs]
        for i in range(truth.cfg.num_layers):
            with truth.layer(i) as layer, recording(Recorder(truth.cfg, False, {}, i)):
                xs = [truth._run(layer, x, pe) for x, pe in zip(xs, pes)]
        w = truth.lm_head()
        rows = max(1, HEAD_ELEMENTS // w.shape[0])
        out = []
        for x, (_, targets) in zip(xs, batches):
            h = truth.final_norm(x)
            out.append([])
            for s, tg in enumerate(targets):
                tg = torch.tensor(tg, device=w.device)
                parts = []
                for lo in range(0, h.shape[1], rows):
                    parts.append(_row_values(h[s, lo:lo + rows] @ w.T, tg[lo:lo + rows]))
                out[-1].append(tuple(torch.cat([p[i] for p in parts]) for i in range(3)))
    return out


def _row_values(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of ``logits [c, V]``: the logprob of ``targets [c]``, the best token, ``logit(best) - logit(target)``."""
    target = logits.gather(1, targets[:, None])[:, 0]
    best = logits.argmax(-1)
    return target - torch.logsumexp(logits, -1), best, logits.gather(1, best[:, None])[:, 0] - target


@contextlib.contextmanager
def fast_fp32(device: torch.device):
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


def _head(truth, h: torch.Tensor, weights: tuple, targets: list[int], tp: int, gen, values=None,
          gemm_dtype: torch.dtype | None = None) -> Probed:
    """The LM head (a BF16 ``dot`` store) of one sequence's replicas ``h [K, T, H]`` (dual), in chunks of rows,
    reduced at once to the per-row statistics against ``targets``. ``weights``: the head's weight, its magnitudes
    and its copy in ``gemm_dtype`` (the tangent's product). ``values``: the rows' ``(logprob, best, gap)`` from the
    fp64 forward (the gap's estimate is then taken for that best token)."""
    w, w_abs, w_low = weights
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
        store = Probe(k, c, tp, gen).perturb("dot", p0.expand(k, c, -1), lambda: hp.abs() @ w_abs.T, width, False)
        z = fwAD.unpack_dual(store).tangent + _tangent_gemm(ht, w_low, gemm_dtype).to(w.dtype)
        tc = tg[lo:lo + c]
        dz = z.gather(2, tc.expand(k, -1)[..., None])[..., 0] - (z * torch.softmax(p0, -1)).sum(-1)
        lp, best, gap = _row_values(p0, tc) if values is None else (v[lo:lo + c] for v in values)
        dg = z.gather(2, best.expand(k, -1)[..., None])[..., 0] - z.gather(2, tc.expand(k, -1)[..., None])[..., 0]
        parts.append((lp, dz.pow(2).mean(0), best, gap, dg.pow(2).mean(0)))
        del store, z
    cat = [torch.cat([p[i] for p in parts]).cpu() for i in range(5)]
    if values is not None:  # the estimates in fp64 beside fp64 values
        cat = [c.double() if c.is_floating_point() else c for c in cat]
    return Probed(cat[0], cat[1], cat[2], cat[3], cat[4], k)

