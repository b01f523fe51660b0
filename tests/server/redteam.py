"""Broken servers written against the golden comparison (a second, independent set next to
tests/server/mutants.py): the reference server with one deliberate bug, on every rank.

    python tests/server/redteam.py --bug NAME [reference server flags]

Each bug is a patch of the reference server's engine (``reference_impl/server/engine.py``) or its collectives,
applied in rank 0 and, through ``REDTEAM_BUG`` in the environment, in every spawned rank before it loads
weights. ``tests/server/test_server_redteam.py`` says which scenario catches each one, or why none can.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ENV = "REDTEAM_BUG"


# ----------------------------------------------------------------------------------------- logprob bugs
def _rewrite_logprobs(fn) -> None:
    """``fn(engine, requests, results)`` rewrites the returned logprobs after each generate."""
    from reference_impl.server.engine import Engine

    original = Engine.generate

    def generate(self, requests):
        results = original(self, requests)
        fn(self, requests, results)
        return results

    Engine.generate = generate


def _each_logprob(transform):
    def fn(_engine, _requests, results):
        for res in results.values():
            res.logprobs = [transform(x) for x in res.logprobs]
    return fn


def _previous_position(_engine, _requests, results):
    for res in results.values():
        res.logprobs = res.logprobs[:1] + res.logprobs[:-1]


def _teacher_forced_logits(engine, request, output_ids) -> torch.Tensor:
    """The served model's logits ``[N, V]`` before each of the N output tokens (one forward of the prefix)."""
    seq = torch.tensor(list(request.input_ids) + list(output_ids[:-1]), dtype=torch.long, device=engine.device)
    return engine.model.logits([seq])[len(request.input_ids) - 1:].double()


def _sampled(transform):
    """Rewrite the logprobs of sampled (temperature > 0) requests from the served model's logits. Every rank
    serves every request at TP1/TP2 without data parallelism, so every rank makes the same forwards."""
    def fn(engine, requests, results):
        for i, res in sorted(results.items()):
            t = requests[i].params.temperature
            if t > 0 and res.output_ids:
                logits = _teacher_forced_logits(engine, requests[i], res.output_ids)
                res.logprobs = [float(transform(row, tok, t)) for row, tok in zip(logits, res.output_ids)]
    return fn


def _every_request(transform):
    """As :func:`_sampled`, for every request (greedy ones pass temperature 1)."""
    def fn(engine, requests, results):
        for i, res in sorted(results.items()):
            if res.output_ids:
                logits = _teacher_forced_logits(engine, requests[i], res.output_ids)
                t = requests[i].params.temperature or 1.0
                res.logprobs = [float(transform(row, tok, t)) for row, tok in zip(logits, res.output_ids)]
    return fn


def _padded_vocab(row, tok, _t, pad: int = 64):
    """log_softmax over a vocabulary padded with ``pad`` unmasked zero logits (a padded LM head)."""
    return row[tok] - torch.logsumexp(torch.cat([row, row.new_zeros(pad)]), -1)


def _top1_instead_of_chosen(row, _tok, _t):
    return torch.log_softmax(row, -1).max()


def _temperature_scaled(row, tok, t):  # SGLang 0.5.23's default (SGLANG_RETURN_ORIGINAL_LOGPROB unset)
    return torch.log_softmax(row / t, -1)[tok]


# ----------------------------------------------------------------------------------------- partial reloads
def _reload_skips(keep) -> None:
    """A reload that copies every tensor except those ``keep(name)`` selects (they keep the old values)."""
    from reference_impl.server.engine import Engine

    def commit_weights(self, new):
        for name, t in self.weights.items():
            if not keep(name):
                t.copy_(new[name])
        self.model.prepare()

    Engine.commit_weights = commit_weights


STALE = {
    "stale_lm_head": lambda n: n == "lm_head.weight",
    "stale_embeddings": lambda n: n == "model.embed_tokens.weight",
    "stale_final_norm": lambda n: n == "model.norm.weight",
    "stale_layer1_mlp": lambda n: n.startswith("model.layers.1.mlp.") and ".gate.weight" not in n,
    "stale_router": lambda n: n.endswith(".mlp.gate.weight"),
    "stale_awq_scales": lambda n: n.endswith(".pre_quant_scale"),
    "stale_one_expert": lambda n: ".mlp.experts.5." in n,
    "stale_weight_scale_2": lambda n: n.endswith(".weight_scale_2"),
    "stale_block_scales": lambda n: n.endswith(".weight_scale"),
    "stale_qk_norms": lambda n: n.endswith(("q_norm.weight", "k_norm.weight")),
    "stale_layer0_input_norm": lambda n: n == "model.layers.0.input_layernorm.weight",
}


# ----------------------------------------------------------------------------------------- timing / routing bugs
def _async_reload(delay_s: float) -> None:
    """Answers success at once and applies the staged weights ``delay_s`` later, at the first generate batch
    after that (as a background loader would, between batches)."""
    from reference_impl.server.engine import Engine

    original_generate = Engine.generate

    def update_weights_from_disk(self, path):
        try:
            staged = self.stage_weights(path)
        except Exception as exc:  # noqa: BLE001
            return False, f"failed: {exc}"
        self._pending = (staged, time.monotonic() + delay_s)
        self.model_path = path
        return True, "Succeeded (applied asynchronously)"

    def generate(self, requests):
        pending = getattr(self, "_pending", None)
        if pending is not None and time.monotonic() >= pending[1]:
            self.commit_weights(pending[0])
            self._pending = None
        return original_generate(self, requests)

    Engine.update_weights_from_disk, Engine.generate = update_weights_from_disk, generate


def _new_weights_for_some_requests(serves_old) -> None:
    """After a reload, a second model keeps the previous weights and serves the generate calls
    ``serves_old(call_index, requests)`` selects (a replica or graph the reload forgot)."""
    from reference_impl.model import TinyModel
    from reference_impl.server.engine import Engine

    original_commit, original_generate = Engine.commit_weights, Engine.generate

    def commit_weights(self, new):
        old = {k: t.clone() for k, t in self.weights.items()}
        self._stale_model = TinyModel(self.cfg, old, self.comm)
        original_commit(self, new)

    def generate(self, requests):
        self._calls = getattr(self, "_calls", 0) + 1
        stale = getattr(self, "_stale_model", None)
        if stale is None or not serves_old(self._calls, requests):
            return original_generate(self, requests)
        current, self.model = self.model, stale
        try:
            return original_generate(self, requests)
        finally:
            self.model = current

    Engine.commit_weights, Engine.generate = commit_weights, generate


def _drop_rank1_partial() -> None:
    """TP all-reduce of the attention/dense-MLP partial sums without rank 1's shard."""
    from reference_impl.server.parallel import DistComm

    original = DistComm.attn_all_reduce

    def attn_all_reduce(self, x):
        if self.topo.attn_size > 1 and self.rank % self.topo.attn_size == 1:
            x.zero_()
        return original(self, x)

    DistComm.attn_all_reduce = attn_all_reduce


BUGS = {
    "none": lambda: None,  # the reference server itself (control)
    "logprobs_two_decimals": lambda: _rewrite_logprobs(_each_logprob(lambda x: round(x, 2))),
    "logprobs_bf16": lambda: _rewrite_logprobs(_each_logprob(lambda x: float(torch.tensor(x).bfloat16()))),
    "logprobs_previous_position": lambda: _rewrite_logprobs(_previous_position),
    "sampled_logprob_of_top1": lambda: _rewrite_logprobs(_sampled(_top1_instead_of_chosen)),
    "temperature_scaled_logprobs": lambda: _rewrite_logprobs(_sampled(_temperature_scaled)),
    "softmax_over_padded_vocab": lambda: _rewrite_logprobs(_every_request(_padded_vocab)),
    **{name: (lambda keep=keep: _reload_skips(keep)) for name, keep in STALE.items()},
    "async_reload_200ms": lambda: _async_reload(0.2),
    "async_reload_20ms": lambda: _async_reload(0.02),
    "old_weights_every_other_call": lambda: _new_weights_for_some_requests(lambda n, _r: n % 2 == 0),
    "old_weights_for_batches": lambda: _new_weights_for_some_requests(lambda _n, r: len(r) > 1),
    "old_weights_for_sampling": lambda: _new_weights_for_some_requests(
        lambda _n, r: any(x.params.temperature > 0 for x in r)),
    "tp_drops_rank1_partial": _drop_rank1_partial,
}


def apply(name: str) -> None:
    BUGS[name]()


def worker(rank, cfg):
    """Spawned ranks: the same bug, then the reference worker loop."""
    from reference_impl.server.parallel import worker_main

    apply(os.environ[ENV])
    worker_main(rank, cfg)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--bug", required=True, choices=sorted(BUGS))
    args, rest = ap.parse_known_args()
    os.environ[ENV] = args.bug
    apply(args.bug)
    from reference_impl.server.__main__ import main as serve

    serve(rest, worker_target=worker)


if __name__ == "__main__":
    main()
