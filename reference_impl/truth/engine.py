"""The truth's engine: transformers' own decoder layers in fp64, one layer at a time (weights streamed from the
checkpoint and dequantized on the fly), with the rounding analysis of :mod:`reference_impl.truth.instrument`.

* :meth:`TruthModel.forward`: one pass over the layers for a batch of sequences (each its own, no padding);
  every layer's weights are dequantized once per pass and freed after it. No KV cache: each pass recomputes
  the prefixes (the prompts are short; one pass streams the weights once either way).
* :meth:`TruthModel.analyse`: the variance proxies of F scalar outputs per sequence by a forward that keeps
  each layer's input, then a reverse sweep that recomputes one layer at a time with its stores and carries the
  gradient batch ``[F, T, H]`` down (``torch.autograd.grad(..., is_grads_batched=True)``, in chunks of F),
  adding every store's contribution at once: nothing but one layer lives in memory. Routing gaps are outputs
  of the layer where they are decided (their rows join the batch there).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from reference_impl.model.architectures import ModelConfig, checkpoint_specs, check_servable
from pathlib import Path

from reference_impl.model import compressed_tensors
from reference_impl.model.checkpoint import HF_QUANT_CONFIG, check_tensors, read_configs
from reference_impl.truth import instrument
from reference_impl.truth.hf import classes, hf_config
from reference_impl.truth.instrument import Recorder, RouteDecision, decisions_per_layer, recording, slot
from reference_impl.truth.stores import NUM_COMPONENTS, Store
from reference_impl.truth.weights import CheckpointFiles, DeviceWeights, TranslatedFiles

#: rows of one batched backward (bounds the gradient temporaries: [chunk, *largest store])
DEFAULT_CHUNK = 256


@dataclass(frozen=True)
class Output:
    """A scalar function of one sequence's logits: ``logprob`` = ``log_softmax(logits[row] / temperature)[token]``
    (``temperature`` None: 1), ``gap`` = ``logits[row, token] - logits[row, other]``."""

    kind: str
    row: int
    token: int
    other: int = -1
    temperature: float | None = None


@dataclass
class Request:
    ids: list[int]
    outputs: list[Output]
    route_rows: int = 0  # routing decisions at positions < route_rows are outputs too


@dataclass
class Analysed:
    values: torch.Tensor            # [F] head outputs, then routing gaps
    variances: torch.Tensor | None  # [F, components]
    routes: list[tuple[int, int]]   # (position, slot) of each routing output, in order after the head outputs


@dataclass
class Pass:
    """What :meth:`TruthModel.forward` returns per sequence."""

    logits: torch.Tensor                                      # [T, V] fp64
    routes: list[RouteDecision] = field(default_factory=list)  # detached gaps, flips


def default_device() -> str:
    """Where the truth runs unless told: ``cuda`` if available, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` (None: :func:`default_device`) checked usable here: ValueError with the reason if not."""
    try:
        d = torch.device(device or default_device())
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{device!r} is not a torch device ({exc})") from exc
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{device!r}: CUDA is not available here (use cpu)")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ValueError(f"{device!r}: only {torch.cuda.device_count()} CUDA device(s)")
    elif d.type != "cpu":
        raise ValueError(f"{device!r}: the truth runs on cuda or cpu")
    return d


def default_cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(0.4 * torch.cuda.get_device_properties(device).total_memory)
    return 4 << 30


class TruthModel:
    """A checkpoint read lazily (every tensor's dtype and shape validated at once, data read when used)."""

    def __init__(self, path: str, device: str | torch.device | None = None, cache_bytes: int | None = None):
        self.path = str(path)
        self.device = resolve_device(device)
        config_json, quant = read_configs(path)
        translated = compressed_tensors.is_compressed_tensors(config_json.get("quantization_config")) and not (
            Path(path) / HF_QUANT_CONFIG).is_file()
        self.files = TranslatedFiles(path) if translated else CheckpointFiles(path)
        lazy = self.files.lazy()
        self.cfg: ModelConfig = ModelConfig.from_hf(config_json, set(lazy))
        check_servable(self.cfg, self.path, quant, lazy)
        check_tensors(lazy, checkpoint_specs(self.cfg, quant), source=self.path)
        self.hf = hf_config(config_json, instrument.NAME, instrument.NAME)
        self.classes = classes(self.cfg)
        instrument.register(self.classes.module)
        cache = default_cache_bytes(self.device) if cache_bytes is None else cache_bytes
        self.weights = DeviceWeights(self.files, self.device, cache)
        self.rotary = self.classes.rotary(self.hf).to(self.device)
        with torch.device("meta"):
            self.final_norm = self.classes.rms_norm(self.cfg.hidden_size, eps=self.cfg.rms_norm_eps)
        self.final_norm.load_state_dict({"weight": self.weights.tensor64("model.norm.weight")}, assign=True)
        self.final_norm.register_forward_hook(instrument.norm_hook)

    # ------------------------------------------------------------------ layers
    @contextlib.contextmanager
    def layer(self, i: int):
        """Decoder layer ``i`` of transformers' class, its weights on the device in fp64, hooks attached."""
        cfg = self.cfg
        with torch.device("meta"):
            m = self.classes.decoder_layer(self.hf, i)
        linears = {n for n, mod in m.named_modules() if isinstance(mod, nn.Linear)}
        sd = {}
        for name in m.state_dict():
            if name.startswith("mlp.experts."):
                continue  # fetched per expert, when a token reaches it (instrument.truth_experts)
            ck = f"model.layers.{i}.{cfg.moe_prefix}.{name[4:]}" if name.startswith("mlp.") and cfg.is_moe(i) \
                else f"model.layers.{i}.{name}"
            if name.endswith(".weight") and name[:-7] in linears:
                sd[name] = self.weights.linear(ck[:-7])
            elif name.startswith("mlp.gate.") and cfg.router == "sigmoid_grouped":
                sd[name] = self.weights.raw(ck).float()  # transformers keeps DeepSeek's router in fp32
            else:
                sd[name] = self.weights.tensor64(ck)
        missing, unexpected = m.load_state_dict(sd, strict=False, assign=True)
        if unexpected or any(not k.startswith("mlp.experts.") for k in missing):
            raise RuntimeError(f"layer {i}: state dict mismatch: missing {missing}, unexpected {unexpected}")
        for n, mod in m.named_modules():
            prefix = f"model.layers.{i}.{n}"
            if isinstance(mod, nn.Linear):
                mod._truth_store = (self._kind(prefix), n.endswith(("o_proj", "down_proj")))  # the probed MLP's
                mod.register_forward_hook(instrument.linear_hook(*mod._truth_store))
                if n.endswith("down_proj"):
                    mod.register_forward_pre_hook(instrument.act_pre_hook)
            elif isinstance(mod, self.classes.rms_norm):
                mod.register_forward_hook(instrument.norm_hook)
        if cfg.is_moe(i):
            m.mlp.gate.register_forward_hook(instrument.router_hook(cfg))
            if cfg.n_shared_experts:
                m.mlp.register_forward_hook(instrument.round_hook)
            # dequantized at each use, never kept: a DeepSeek-V3 layer's 256 experts are 90 GB in fp64
            m.mlp.experts._truth_weights = lambda e: tuple(self.weights.linear(cfg.expert(i, e, w)) for w in range(3))
            m.mlp.experts._truth_kind = self._kind(cfg.expert(i, 0, 0))
        m.eval()
        try:
            yield m
        finally:
            del m, sd

    def _kind(self, prefix: str) -> str:
        if not self.weights.is_quantized(prefix):
            return "linear_exact"
        return "linear_awq" if ".experts." not in prefix and self.weights.has(f"{prefix}.pre_quant_scale") else "linear"

    def _positions(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(x.shape[1], device=self.device)[None]
        return self.rotary(x, pos)

    @staticmethod
    def _run(layer: nn.Module, x: torch.Tensor, pe) -> torch.Tensor:
        """The decoder layer's residual structure (every supported architecture's), its two sums stored."""
        rec = instrument.active()
        h = layer.self_attn(hidden_states=layer.input_layernorm(x), position_embeddings=pe, attention_mask=None)[0]
        x = rec.store(x + h, "round")
        return rec.store(x + layer.mlp(layer.post_attention_layernorm(x)), "round")

    def embed(self, ids: list[int]) -> torch.Tensor:
        emb = self.weights.raw("model.embed_tokens.weight")
        return emb[torch.tensor(ids, device=emb.device)].double()[None]

    def lm_head(self) -> torch.Tensor:
        return self.weights.tensor64("model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight")

    def head(self, h: torch.Tensor, rec: Recorder) -> torch.Tensor:
        """Final norm and LM head ``[T, V]`` (an engine's LM head writes BF16 logits: a ``dot`` store)."""
        w = self.lm_head()
        h = self.final_norm(h)[0]
        return rec.store(h @ w.T, "dot", lambda: h.detach().abs() @ w.abs().T, h.shape[-1])

    # ------------------------------------------------------------------ forward
    def forward(self, seqs: list[list[int]], forced: list[dict] | None = None,
                keep_inputs: bool = False) -> tuple[list[Pass], list[list[torch.Tensor]] | None]:
        """Logits and routing decisions of every sequence (``forced[s]``: decisions taken the other way,
        ``(slot, position) -> (drop, add)``); with ``keep_inputs`` also every layer's input per sequence."""
        forced = forced or [{} for _ in seqs]
        with torch.no_grad():
            xs = [self.embed(s) for s in seqs]
            pes = [self._positions(x) for x in xs]
            passes = [Pass(torch.empty(0)) for _ in seqs]
            kept = [[] for _ in seqs] if keep_inputs else None
            for i in range(self.cfg.num_layers):
                with self.layer(i) as layer:
                    for s in range(len(seqs)):
                        if kept is not None:
                            kept[s].append(xs[s])
                        rec = Recorder(self.cfg, False, forced[s], i)
                        with recording(rec):
                            xs[s] = self._run(layer, xs[s], pes[s])
                        passes[s].routes += rec.routes
            for s in range(len(seqs)):
                if kept is not None:
                    kept[s].append(xs[s])
                with recording(Recorder(self.cfg, False)):
                    passes[s].logits = self.head(xs[s], instrument.active())
        return passes, kept

    # ------------------------------------------------------------------ analysis
    def analyse(self, requests: list[Request], variances: bool = True, kept=None, chunk: int = DEFAULT_CHUNK
                ) -> list[Analysed]:
        """Values (and variance proxies) of every request's outputs; ``kept``: :meth:`forward`'s layer inputs of
        exactly these sequences (saves the first pass)."""
        if kept is None:
            kept = self.forward([r.ids for r in requests], keep_inputs=True)[1]
        results = []
        grads: list[torch.Tensor] = []
        var: list[list[torch.Tensor]] = []
        for r, inputs in zip(requests, kept):  # the head: outputs of the final hidden state
            x = inputs[-1].detach().requires_grad_(variances)
            rec = Recorder(self.cfg, variances)
            with recording(rec), torch.enable_grad():
                logits = self.head(x, rec)
                f = torch.stack([_output(logits, o) for o in r.outputs]) if r.outputs else logits.new_zeros(0)
            results.append(Analysed(f.detach(), None, []))
            if not variances:
                grads.append(None)
                continue
            n = len(r.outputs)
            v = [f.new_zeros(n, NUM_COMPONENTS)]
            g = _backward(rec.stores, x, [f], [torch.eye(n, dtype=f.dtype, device=f.device)], v[0], chunk)
            grads.append(g)
            var.append(v)
        if not any(r.route_rows for r in requests) and not variances:
            return results
        for i in reversed(range(self.cfg.num_layers)):
            with self.layer(i) as layer:
                for s, r in enumerate(requests):
                    self._layer_backward(layer, i, r, kept[s], results[s], grads, var[s] if variances else None, s,
                                         variances, chunk)
                    kept[s][i + 1] = None  # free as we go down
        for s, res in enumerate(results):
            if variances:
                # rows: head outputs, then routes in the order their layers were reached (top layer first)
                res.variances = torch.cat(var[s])
        return results

    def _layer_backward(self, layer, i, r: Request, inputs, res: Analysed, grads, var, s, variances, chunk):
        x = inputs[i].detach().requires_grad_(variances)
        rec = Recorder(self.cfg, variances, {}, i)
        with recording(rec), torch.enable_grad():
            y = self._run(layer, x, self._positions(x))
            gaps = [(d, t) for d in rec.routes for t in range(min(r.route_rows, d.gaps.shape[0]))]
            r_out = torch.stack([d.gaps[t] for d, t in gaps]) if gaps else y.new_zeros(0)
        finite = [k for k, (d, t) in enumerate(gaps) if bool(torch.isfinite(r_out[k].detach()))]
        res.values = torch.cat([res.values, r_out.detach()[finite]])
        res.routes += [(gaps[k][1], slot(self.cfg, gaps[k][0].layer, gaps[k][0].kind)) for k in finite]
        if not variances:
            return
        g_in, n_new = grads[s], len(finite)
        f_old = g_in.shape[0]
        go_y = torch.cat([g_in, g_in.new_zeros(n_new, *g_in.shape[1:])])
        go_r = r_out.new_zeros(f_old + n_new, r_out.shape[0])
        for row, k in enumerate(finite):
            go_r[f_old + row, k] = 1.0
        v_new = y.new_zeros(f_old + n_new, NUM_COMPONENTS)
        outputs, gos = ([y, r_out], [go_y, go_r]) if gaps else ([y], [go_y])
        grads[s] = _backward(rec.stores, x, outputs, gos, v_new, chunk)
        # v_new rows: the old rows (in their order across var blocks), then the new routes
        offset = 0
        for block in var:
            block += v_new[offset:offset + block.shape[0]]
            offset += block.shape[0]
        var.append(v_new[f_old:].clone())


def _backward(stores: list[Store], x: torch.Tensor, outputs, grad_outputs, var: torch.Tensor, chunk: int) -> torch.Tensor:
    """Add every store's contribution to ``var [F, C]`` and return ``d outputs / dx`` ``[F, *x.shape]``,
    in batched backward passes of ``chunk`` rows."""
    f = grad_outputs[0].shape[0]
    if f == 0:
        return x.new_zeros(0, *x.shape)
    leaves = [st.leaf for st in stores]
    g_x = []
    for lo in range(0, f, chunk):
        hi = min(f, lo + chunk)
        gs = torch.autograd.grad(outputs, [x] + leaves, [g[lo:hi] for g in grad_outputs], retain_graph=True,
                                 allow_unused=True, is_grads_batched=True)
        g_x.append(gs[0].detach() if gs[0] is not None else x.new_zeros(hi - lo, *x.shape))
        for st, g in zip(stores, gs[1:]):
            if g is not None:
                var[lo:hi] += st.variances(g.detach())
        del gs
    return torch.cat(g_x)


def _output(logits: torch.Tensor, o: Output) -> torch.Tensor:
    row = logits[o.row]
    if o.kind == "gap":
        return row[o.token] - row[o.other]
    if o.temperature is not None:
        row = row / o.temperature
    return torch.log_softmax(row, -1)[o.token]


__all__ = ["Output", "Request", "Analysed", "Pass", "TruthModel", "default_device", "resolve_device",
           "decisions_per_layer"]
