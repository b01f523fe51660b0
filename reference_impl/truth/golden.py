"""Golden outputs of the reference model for the server scenarios, with the first-order sensitivities from
which ``conformance/server/bounds.py`` derives how far a correct engine may be from them.

The truth is transformers' own model class of the checkpoint's architecture in fp64 with the checkpoint's
exactly dequantized weights (``e2m1 * e4m3 * weight_scale_2``, AWQ scale folded into the columns), run one
layer at a time on the truth device (:mod:`reference_impl.truth`); transformers' fp32 stages (RMSNorm
statistics, rotary tables, softmaxes, DeepSeek-V3's router) are kept. For each prompt: its greedy continuation,
each chosen token's logprob, the reference's top-``K`` candidates at each step with their logit gaps to the
top-1, and for every MoE routing decision its near-tie gap: the k-th minus the (k+1)-th router logit
(softmax routers), and for DeepSeek-V3 the k-th minus the (k+1)-th biased score among the experts of the
chosen groups and the ``topk_group``-th minus the next group score (a group's score: its two best biased
scores summed). Decisions are indexed by *slot* ``layer * D + d`` (``D`` = 2 for DeepSeek-V3: d = 0 expert,
1 group; else 1).

**Own error of the truth.** fp64 arithmetic (unit roundoff ``2^-53``) adds a relative error of about
``(n + 2) 2^-53`` per dot product of length n, ``2^-30`` of the fp32 accumulation term of the bound. The fp32
stages err by at most 2 fp32 ulps (``2^-22`` relative; CPU and CUDA math libraries differ by that much) per
element: to first order ``|d f| <= 2^-22 sum_i |s_i| |v_i|`` over those stores, while the bound is
``6 * 2^-8 * sqrt(sum_i (s_i c_i)^2)`` over all stores (each fp32 stage is also a store with ``c_i = |v_i|``).
By Cauchy-Schwarz the ratio is at most ``2^-14 / 6 * sqrt(N)`` for N fp32-stage elements: 2 % for
Llama-3.1-8B and 4 prompts of 13 tokens (``N`` about 4e6), and about ``2^-14 / 6 = 1e-5`` with errors
independent (the model the bound itself uses). The truth on the GPU and on the CPU agree to that order.

**Rounding analysis.** A serving engine stores intermediates in BF16 (:mod:`reference_impl.truth.stores`
lists every kind of store and where the truth observes it). Each store gets a zero perturbation leaf ``d_v``, so
backward passes give ``df/dv`` for every store. To first order an engine's ``f`` differs from the exact one by
``sum_i (df/dv_i) * e_i`` over its individual rounding errors ``e_i``, each bounded by ``|e_i| <= c_i``
(Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., 3.1). Modelling rounding errors as
independent and mean zero (Higham and Mary, "A New Approach to Probabilistic Rounding Error Analysis", SIAM J.
Sci. Comput. 41(5), 2019), Hoeffding's inequality gives ``P(|df| >= lam * sqrt(sum_i (df/dv_i * c_i)^2)) <=
2 exp(-lam^2 / 2)``. This module computes the *variance proxies* ``sum_i (df/dv_i * c_i / unit)^2``, in the
components :data:`COMPONENTS`, whose unit roundoffs ``conformance/server/bounds.py`` applies, next to the check:

* ``bf16`` (unit ``2^-8``): every BF16 rounding an engine may make: the stored value (``|v|``; twice for
  ``silu(gate) * up`` and for an RMSNorm output: the normalised row and its product with the weight), rounded
  products before a sum (rotary embedding: ``|q cos| + |rot(q) sin|``; MoE combine: ``(top_k + 1)`` roundings
  of at most ``sum_k |w_k y_k|``), the dequantized weight ``W * weight_scale_2`` rounded for a BF16 GEMM (one
  variable per weight element, ``|W_nk| * sum_t |df/dy_tn| |x_tk|``: the same rounded weight serves every
  token), and an AWQ input ``x * pre_quant_scale`` rounded (``|x'_tk| * |(df/dy @ W)_tk|``);
* ``accum`` (unit ``2^-23``, fp32 accumulation, one ulp per addition as tensor cores truncate): every
  reduction of length ``n`` (linear, attention scores and values, router, LM head) errs by at most
  ``(n + 2) * M`` with ``M`` the sum of the absolute products;
* ``tp2``, ``tp4``, ``tp8`` (unit ``2^-8``, added at that tensor-parallel size): row-parallel outputs
  (attention ``o_proj``, MLP ``down_proj``) when each rank's partial sum and the all-reduce's running sums
  are rounded to BF16 (the actual partials of contiguous input slices); the MoE combine, ``tp`` roundings
  of at most ``sum_k |w_k| A_k`` (``A_k`` bounds any rank's partial of expert ``k``'s output).

The per-output backward passes are batched (one batched backward per layer for all F outputs of a
sequence, :mod:`reference_impl.truth.engine`), so the cost is a few passes over the weights, not F.

Discrete decisions are not differentiable: a greedy token whose gap to another candidate is inside that
gap's bound, or a routing decision whose gap is inside its bound, may legitimately go the other way. The
golden outputs record the gaps; :meth:`ExactModel.gap_variance` and :meth:`ExactModel.branch` answer on
demand, when an engine diverges (see ``conformance/server/golden.py``).

**Teacher forcing.** :meth:`ExactModel.golden` takes ``candidates`` (an engine's greedy continuations): one
forward over prompt + candidate gives the reference's logits at every step given that prefix, so where the
candidate is the reference's own greedy path (argmax at every step) the golden path costs one pass instead of
one per step; from the first step where it is not, the reference continues greedily. The golden outputs are
the reference's greedy path either way (exactly: the same logits decide).
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
from dataclasses import dataclass

import torch

from reference_impl.truth.engine import Output, Request, TruthModel
from reference_impl.truth.instrument import RouteDecision, decisions_per_layer
from reference_impl.truth.stores import NUM_COMPONENTS, TP_SIZES  # noqa: F401  (TP_SIZES re-exported)

#: Sensitivity components, in this order, in every ``*_var`` tensor (last dimension).
COMPONENTS = ("bf16", "accum") + tuple(f"tp{tp}" for tp in TP_SIZES)
TOP_K = 2
assert len(COMPONENTS) == NUM_COMPONENTS


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
    route_gaps: torch.Tensor      # [P, T, S] fp64: the routing decision of slot s at position t; +inf: none
    route_var: torch.Tensor       # [P, T, S, C]

    @property
    def max_new_tokens(self) -> int:
        return int(self.output_ids.shape[1])


@dataclass
class ForcedPath:
    """:meth:`ExactModel.forced`: per step the token's raw and temperature-scaled logprob with variance proxies
    (``[N]`` and ``[N, C]``), and every routing decision ``(position, slot, gap, variance proxies)``."""

    raw: torch.Tensor
    raw_var: torch.Tensor
    scaled: torch.Tensor
    scaled_var: torch.Tensor
    routes: list[tuple[int, int, float, torch.Tensor]]


@dataclass
class TeacherForced:
    """:meth:`ExactModel.teacher_forced`: the sequence ``prompt + continuation`` (an engine's own tokens) judged at
    every position after the first. Row ``k`` is the prediction of token ``k + 1`` from tokens ``0..k``: rows
    ``0 .. L-2`` score the prompt's tokens, rows ``L-1 ..`` the continuation's (row ``L-1``, the first generated
    token, comes from the prefill's forward).

    ``logprob[k]``: the reference's logprob of token ``k + 1``; ``best[k]``: its argmax at row ``k``; ``gap[k]``:
    ``logit(best) - logit(token k + 1) >= 0`` (0 where they are the same token). ``*_var``: the variance
    estimates ``V_hat`` (absolute units, the server's TP size included) of :mod:`reference_impl.truth.probes` from
    ``probes`` probes, bounded with :func:`reference_impl.truth.probes.probe_lambda`. ``routes``: every routing
    decision ``(position, slot, gap, V_hat)``."""

    prompt_len: int
    tokens: list[int]
    logprob: torch.Tensor
    logprob_var: torch.Tensor
    best: torch.Tensor
    gap: torch.Tensor
    gap_var: torch.Tensor
    routes: list[tuple[int, int, float, float]]
    probes: int
    tp: int


def checkpoint_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the sorted tensor names, dtypes, shapes and bytes (independent of the file layout);
    :meth:`reference_impl.truth.weights.CheckpointFiles.digest` computes the same from the files."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


_DIGESTS: dict[tuple, str] = {}  # file identity -> digest, for this process
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="checkpoint-digest")


def digest_in_background(files) -> "concurrent.futures.Future[str]":
    """The full-content digest of a checkpoint, hashed on a thread while the truth computes (hashlib and the
    file reads release the GIL), through handles of its own. Memoised per process by the files' identity
    (path, name, size, mtime_ns, inode of every ``*.safetensors``): a second model of the same unchanged
    checkpoint does not hash again. The digest itself still covers every byte."""
    from pathlib import Path

    from reference_impl.truth.weights import CheckpointFiles

    root = Path(files.path)
    key = (str(root.resolve()), type(files).__name__,
           tuple((f.name, st.st_size, st.st_mtime_ns, st.st_ino)
                 for f in sorted(root.glob("*.safetensors")) for st in [f.stat()]))
    done = _DIGESTS.get(key)
    if done is not None:
        fut: concurrent.futures.Future[str] = concurrent.futures.Future()
        fut.set_result(done)
        return fut

    def run() -> str:
        own = CheckpointFiles(files.path) if isinstance(files, CheckpointFiles) else files
        _DIGESTS[key] = own.digest()
        return _DIGESTS[key]

    return _POOL.submit(run)


def _ints(ids) -> tuple[int, ...]:
    return tuple(int(t) for t in ids)


def _tensor_bytes(value) -> int:
    """Bytes of the tensors in ``value`` (tensors, tuples, lists, dataclasses of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):  # Python objects counted at 64 bytes each (routes are tuples of floats)
        return sum(_tensor_bytes(v) if isinstance(v, (torch.Tensor, tuple, list)) or dataclasses.is_dataclass(v)
                   else 64 for v in value)
    if dataclasses.is_dataclass(value):
        return sum(_tensor_bytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 0


class ExactModel:
    """A checkpoint's truth (:class:`reference_impl.truth.engine.TruthModel`) for golden outputs and on-demand
    gaps. ``device``: where the fp64 truth runs (default: CUDA if available)."""

    def __init__(self, model_path: str, device: str | None = None, cache_bytes: int | None = None):
        self.path = str(model_path)
        self.truth = TruthModel(self.path, device, cache_bytes)
        self.cfg = self.truth.cfg
        self._digest = digest_in_background(self.truth.files)
        self._weights = None
        self._answers: collections.OrderedDict = collections.OrderedDict()  # key -> (answer, tensor bytes)
        self._answer_bytes = 0

    #: On-demand answers kept (least recently used dropped first), at most this many bytes of tensors (a
    #: branch's logits are ``[steps, vocabulary]`` fp64 on the truth device: 8 MB for a 128k vocabulary). They
    #: are pure functions of the checkpoint and the question, and scenario runs ask the same ones again (an
    #: engine diverges at the same step in every scenario that sends that prompt): without the memo each is a
    #: forward (and a backward) again.
    ANSWER_BYTES_KEPT = 256 << 20

    def _memo(self, key: tuple, compute):
        """``compute()``, or its earlier result for ``key`` (the caller must not modify what it returns)."""
        if key in self._answers:
            self._answers.move_to_end(key)
            return self._answers[key][0]
        value = compute()
        size = _tensor_bytes(value)
        self._answers[key] = (value, size)
        self._answer_bytes += size
        while self._answer_bytes > self.ANSWER_BYTES_KEPT and self._answers:
            self._answer_bytes -= self._answers.popitem(last=False)[1][1]
        return value

    @property
    def digest(self) -> str:
        """:func:`checkpoint_digest` of the checkpoint (hashed in a background thread from the start; waits)."""
        return self._digest.result()

    @property
    def slots(self) -> int:
        return self.cfg.num_layers * decisions_per_layer(self.cfg)

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors as the hand-written model takes them (read on first use)."""
        if self._weights is None:
            from reference_impl.model.checkpoint import load_checkpoint
            from reference_impl.model import shard_weights

            self._weights = shard_weights(self.cfg, load_checkpoint(self.path).tensors)
        return self._weights

    def greedy(self, prompts: list[list[int]], steps: int, candidates: list[list[int]] | None = None):
        """Greedy continuations, and per prompt the forward of ``prompt + continuation[:-1]`` (its logits and
        layer inputs, for :meth:`golden`'s analysis). A candidate continuation is checked by teacher forcing
        and kept up to its first step that is not the reference's argmax."""
        conts: list[list[int]] = [[] for _ in prompts]
        done: dict[int, tuple[torch.Tensor, list]] = {}
        if candidates is not None:
            idx = [i for i, c in enumerate(candidates) if c is not None and len(c) >= steps]
            passes, kept = self.truth.forward([list(prompts[i]) + list(candidates[i][:steps - 1]) for i in idx],
                                              keep_inputs=True)
            for n, i in enumerate(idx):
                lp = len(prompts[i])
                best = passes[n].logits[lp - 1:].argmax(-1).tolist()
                cand = list(candidates[i][:steps])
                first = next((j for j in range(steps) if best[j] != cand[j]), None)
                if first is None:
                    conts[i], done[i] = cand, (passes[n].logits, kept[n])
                else:
                    conts[i] = cand[:first] + [best[first]]
        while len(done) < len(prompts):
            todo = [i for i in range(len(prompts)) if i not in done]
            passes, kept = self.truth.forward([list(prompts[i]) + conts[i] for i in todo], keep_inputs=True)
            for n, i in enumerate(todo):
                conts[i].append(int(passes[n].logits[-1].argmax()))
                if len(conts[i]) == steps:
                    # the pass just made was over prompt + continuation[:-1]: exactly the analysis' forward
                    done[i] = (passes[n].logits, kept[n])
        return conts, [done[i] for i in range(len(prompts))]

    def _analyse(self, prompt, continuation, outputs: list[Output], routes: bool, variances: bool = True, kept=None):
        seq = list(prompt) + list(continuation[:-1])
        req = Request(seq, outputs, len(seq) if routes else 0)
        return self.truth.analyse([req], variances, kept=None if kept is None else [kept])[0]

    def gap_variance(self, prompt: list[int], continuation: list[int], step: int, token: int) -> tuple[float, torch.Tensor]:
        """(gap, variance proxies) of ``logit(continuation[step]) - logit(token)`` at ``step`` (on demand, for
        a token outside the stored top-K)."""
        def compute():
            row = len(prompt) - 1 + step
            res = self._analyse(prompt, continuation, [Output("gap", row, continuation[step], token)], False)
            return float(res.values[0]), res.variances[0]

        return self._memo(("gap", _ints(prompt), _ints(continuation), int(step), int(token)), compute)

    def branch(self, prompt: list[int], continuation: list[int],
               forced: dict[tuple[int, int], tuple[int, int]]) -> tuple[torch.Tensor, list[RouteDecision]]:
        """Step logits ``[N, V]`` and routing decisions of the reference's path with the decisions ``forced``
        ((slot, position) -> (drop, add)) taken the other way; every other decision is recomputed, so the flips'
        consequences downstream are included."""
        def compute():
            passes, _ = self.truth.forward([list(prompt) + list(continuation[:-1])], forced=[dict(forced)])
            return passes[0].logits[len(prompt) - 1:], passes[0].routes

        return self._memo(("branch", _ints(prompt), _ints(continuation), tuple(sorted(forced.items()))), compute)

    def forced(self, prompt: list[int], continuation: list[int], temperature: float) -> ForcedPath:
        """The reference's answer for a continuation it did not choose (a sampled one): at each step the
        logprob of the continuation's token, raw (``log_softmax(logits)``) and temperature-scaled
        (``log_softmax(logits / temperature)``), and the path's routing gaps, each with its variance proxies."""
        def compute():
            n, lp = len(continuation), len(prompt)
            outs = [Output("logprob", lp - 1 + j, continuation[j]) for j in range(n)]
            outs += [Output("logprob", lp - 1 + j, continuation[j], temperature=temperature) for j in range(n)]
            res = self._analyse(prompt, continuation, outs, True)
            v, var = res.values, res.variances
            routes = [(t, s, float(v[2 * n + k]), var[2 * n + k]) for k, (t, s) in enumerate(res.routes)]
            return ForcedPath(v[:n], var[:n], v[n:2 * n], var[n:2 * n], routes)

        return self._memo(("forced", _ints(prompt), _ints(continuation), float(temperature)), compute)

    def teacher_forced(self, prompt: list[int], continuation: list[int], probes: int | None = None, tp: int = 1,
                       seed: int = 0, precision: str = "fp64") -> TeacherForced:
        """``prompt + continuation`` teacher forced (:class:`TeacherForced`); see :meth:`teacher_forced_many`."""
        return self.teacher_forced_many([(prompt, continuation)], probes, tp, seed, precision=precision)[0]

    def teacher_forced_many(self, pairs: list[tuple[list[int], list[int]]], probes: int | None = None, tp: int = 1,
                            seed: int = 0, max_rows: int | None = None, precision: str = "fp64"
                            ) -> list[TeacherForced]:
        """Each ``(prompt, continuation)`` teacher forced (:class:`TeacherForced`): forward-mode passes of
        ``probes`` replicas (:mod:`reference_impl.truth.probes`; sequences of equal length share one) give every
        position's values and variance estimates. Memoized per question, like the other on-demand answers (an
        engine that gives the same continuation in several batches is judged once). ``precision``: the probed
        passes' (:data:`reference_impl.truth.probes.PRECISIONS`)."""
        from reference_impl.truth.probes import DEFAULT_PROBES, probe_sequences, route_outputs

        probes = probes or DEFAULT_PROBES
        keys = [("teacher", _ints(p), _ints(c), probes, tp, seed, precision) for p, c in pairs]
        for (p, c) in pairs:
            if not p or len(p) + len(c) < 2:
                raise ValueError("teacher forcing needs a prompt and at least 2 tokens in all (one to predict)")
        found = {k: self._answers[k][0] for k in keys if k in self._answers}
        todo = list(dict.fromkeys(k for k in keys if k not in found))
        seqs = [list(k[1]) + list(k[2]) for k in todo]
        probed_all = probe_sequences(self.truth, [q[:-1] for q in seqs], [q[1:] for q in seqs], probes, tp, seed,
                                     max_rows, precision)
        for k, seq, probed in zip(todo, seqs, probed_all):
            answer = TeacherForced(len(k[1]), seq, probed.logprob, probed.logprob_var, probed.best, probed.gap,
                                   probed.gap_var, route_outputs(self.cfg, probed), probes, tp)
            found[k] = self._memo(k, lambda answer=answer: answer)
        for k in keys:
            if k in self._answers:
                self._answers.move_to_end(k)
        return [found[k] for k in keys]

    def golden(self, prompts: list[list[int]], steps: int, top_k: int = TOP_K, variances: bool = True,
               candidates: list[list[int]] | None = None) -> GoldenSet:
        """Greedy outputs, logprobs, top-K logit gaps and routing gaps, with the variance proxies of the
        logprobs and routing gaps (``variances=False``: values only, zeros instead; for cheap re-checks).
        ``candidates``: continuations to verify by teacher forcing first (see the module docstring).
        Variances of other gaps and other routings (:meth:`branch`) are computed on demand, when an engine
        diverges."""
        p, k, c = len(prompts), min(top_k, self.cfg.vocab_size), NUM_COMPONENTS
        t_max = max(len(x) for x in prompts) + steps - 1
        out = GoldenSet("", [list(x) for x in prompts], torch.zeros(p, steps, dtype=torch.int64),
                        torch.zeros(p, steps, dtype=torch.float64), torch.zeros(p, steps, c, dtype=torch.float64),
                        torch.zeros(p, steps, k, dtype=torch.int64), torch.zeros(p, steps, k, dtype=torch.float64),
                        torch.full((p, t_max, self.slots), float("inf"), dtype=torch.float64),
                        torch.zeros(p, t_max, self.slots, c, dtype=torch.float64))
        conts, forwards = self.greedy(prompts, steps, candidates)
        requests, kept = [], []
        for i, (prompt, cont, (logits, inputs)) in enumerate(zip(prompts, conts, forwards)):
            top = torch.topk(logits[len(prompt) - 1:].cpu(), k, dim=-1)
            if top.indices[:, 0].tolist() != cont:  # the same fp64 logits decided; only an exact tie could do this
                raise RuntimeError(f"prompt {i}: greedy path {cont} and the analysed logits' argmax "
                                   f"{top.indices[:, 0].tolist()} disagree (an exact tie); use other prompts")
            out.output_ids[i], out.top_ids[i] = torch.tensor(cont), top.indices
            out.top_gaps[i] = top.values[:, :1] - top.values
            seq = list(prompt) + cont[:-1]
            requests.append(Request(seq, [Output("logprob", len(prompt) - 1 + j, cont[j]) for j in range(steps)],
                                    len(seq)))
            kept.append(inputs)
        results = self.truth.analyse(requests, variances, kept=kept)
        for i, res in enumerate(results):
            values = res.values.cpu()
            var = res.variances.cpu() if variances else torch.zeros(len(values), c, dtype=torch.float64)
            out.logprobs[i], out.logprob_var[i] = values[:steps], var[:steps]
            for n, (t, s) in enumerate(res.routes):
                out.route_gaps[i, t, s] = values[steps + n]
                out.route_var[i, t, s] = var[steps + n]
        out.checkpoint_digest = self.digest  # hashed meanwhile
        return out
