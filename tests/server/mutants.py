"""Deliberately broken reference servers (and correct-but-different ones) for the server scenarios.

    python tests/server/mutants.py --mutant NAME --model-path DIR --port P [server flags, --tp N too]

Each mutant patches one behaviour of the reference server and must be rejected by the named scenario in
tests/server/test_server_mutants.py; ``rebinding_reload`` and ``fp32_engine`` are correct and must be accepted.
The patch is applied in every rank (spawned ranks run :func:`_patched_worker` first).
The scheduling and pace stand-ins are in tests/server/pace_mutants.py, the workload-class ones in
tests/server/workload_mutants.py; ``MUTANTS`` here names them all.
"""
from __future__ import annotations

import functools
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from reference_impl.model.checkpoint import load_checkpoint  # noqa: E402
from reference_impl.model import TinyModel  # noqa: E402
from reference_impl.server.__main__ import main as server_main  # noqa: E402
from reference_impl.server.app import Scheduler  # noqa: E402
from reference_impl.server.engine import Engine, GenerateResult  # noqa: E402
from reference_impl.server.parallel import worker_main  # noqa: E402
from tests.server.pace_mutants import (  # noqa: E402
    cobatch_variant_only,
    drops_one_request,
    random_cobatching,
    random_cobatching_batch_variant,
    slow_3x,
    slows_down,
)
from tests.server.workload_mutants import (  # noqa: E402
    bucketed_reduction_order,
    large_batch_stale_after_reload,
    large_decode_batch_drops_k_block,
    large_prefill_drops_k_block,
    moe_expert_workspace_32,
)


def reload_keeps_old_weights() -> dict:
    """Reports success but never touches the weights."""
    def update(self, path):
        return True, f"Succeeded to update model weights from {path!r}."
    Engine.update_weights_from_disk = update
    return {}


def reload_drops_awq_scale() -> dict:
    """The reload path forgets pre_quant_scale: the parameter keeps its default of ones."""
    original = Engine.stage_weights

    def stage(self, path):
        staged = original(self, path)
        return {k: (torch.ones_like(v) if k.endswith(".pre_quant_scale") else v) for k, v in staged.items()}
    Engine.stage_weights = stage
    return {}


def nondeterministic_reduction() -> dict:
    """Split-K linear whose partial sums are rounded to BF16 and added in a random order per call."""
    def linear(self, x, prefix):
        if self._decoded is None:
            self.prepare()
        xd = x.double()
        pqs = self.w.get(f"{prefix}.pre_quant_scale")
        if pqs is not None:
            xd = xd * pqs.double()
        deq = self._decoded[prefix]
        chunks = list(range(0, deq.shape[1], 16))
        order = torch.randperm(len(chunks)).tolist()
        acc = torch.zeros(xd.shape[0], deq.shape[0], dtype=torch.bfloat16, device=x.device)
        for c in order:
            k = chunks[c]
            acc = acc + (xd[:, k:k + 16] @ deq[:, k:k + 16].T).to(torch.bfloat16)
        return acc.double() * self.w[f"{prefix}.weight_scale_2"].double()
    TinyModel.linear = linear
    return {}


class _DroppingScheduler(Scheduler):
    """A reload takes a while; generate requests that queue up meanwhile are aborted, not served."""

    def run_batch(self, batch):
        if batch[0].kind == "update":
            time.sleep(0.5)
            result = self.command(("update", batch[0].arg))
            with self._cv:
                dropped = [j for j in self._jobs if j.kind == "generate"]
                self._jobs = type(self._jobs)(j for j in self._jobs if j.kind != "generate")
            for job in dropped:
                job.resolve([GenerateResult([], [], {"type": "abort", "message": "aborted by weight update"})
                             for _ in job.arg])
            batch[0].resolve(result)
            return
        super().run_batch(batch)


def drops_requests_during_reload() -> dict:
    return {"scheduler_cls": _DroppingScheduler}


class _AbortingPauseScheduler(Scheduler):
    """vLLM's ``/pause?mode=wait`` treated as ``mode=abort``: the generate requests in flight when the pause
    drains the queue (its "flush" job) are answered as aborted instead of being finished. Generation takes
    0.2 s a batch (a slow engine), so the requests sent just before a reload are in flight when it pauses (or,
    where the pause comes late, those sent during the reload)."""

    def __init__(self, runtime):
        self._abort = threading.Event()
        super().__init__(runtime)

    async def submit(self, kind, arg):
        if kind == "flush":
            self._abort.set()
            with self._cv:
                queued = [j for j in self._jobs if j.kind == "generate"]
                self._jobs = type(self._jobs)(j for j in self._jobs if j.kind != "generate")
            for job in queued:
                job.resolve(_aborted(job))
        return await super().submit(kind, arg)

    def run_batch(self, batch):
        if batch[0].kind == "flush":
            self._abort.clear()
        super().run_batch(batch)

    def run_generate(self, batch):
        time.sleep(0.2)
        if self._abort.is_set():
            for job in batch:
                job.resolve(_aborted(job))
            return
        super().run_generate(batch)


def _aborted(job) -> list:
    return [GenerateResult([], [], {"type": "abort", "message": "aborted by pause"}) for _ in job.arg]


def pause_aborts_in_flight_requests() -> dict:
    return {"scheduler_cls": _AbortingPauseScheduler}


def half_loaded_on_failure() -> dict:
    """Copies tensor by tensor straight into the served weights and stops at the first missing one."""
    def update(self, path):
        try:
            ckpt = load_checkpoint(path)
        except Exception as exc:  # noqa: BLE001
            return False, str(exc)
        for name in sorted(self.weights):
            src = ckpt.tensors.get(name)
            if src is None:
                self.model.prepare()
                return False, f"missing tensor {name!r}"
            self.weights[name].copy_(src.reshape(self.weights[name].shape))
        self.model.prepare()
        return True, "ok"
    Engine.update_weights_from_disk = update
    return {}


def batch_dependent_numerics() -> dict:
    """Deterministic, but a sequence's logits depend on how many sequences share its forward pass (as when
    a kernel picks its split by batch size): exact repeats agree, batch sizes do not."""
    original = TinyModel.last_logits

    def last_logits(self, seqs):
        return original(self, seqs) * (1.0 + 2.0 ** -10 * (len(seqs) - 1))
    TinyModel.last_logits = last_logits
    return {}


def rebinding_reload() -> dict:
    """Correct but different: a reload allocates new tensors instead of copying in place."""
    def commit(self, new):
        self.weights.clear()
        self.weights.update(new)
        self.model.prepare()
    Engine.commit_weights = commit
    return {}


def _patch_logprobs(transform) -> None:
    original = Engine.generate

    def generate(self, requests):
        results = original(self, requests)
        for res in results.values():
            res.logprobs = transform(list(res.logprobs))
        return results
    Engine.generate = generate


def logprobs_truncated() -> dict:
    """Logprobs truncated to integers (a wrongly typed field on the way out): deterministic, so every
    self-consistency check passes; the values are wrong."""
    _patch_logprobs(lambda lps: [float(int(x)) for x in lps])
    return {}


def logprobs_of_next_position() -> dict:
    """Each token reported with the logprob of the token after it (an off-by-one in assembling the
    output; the last one repeated)."""
    _patch_logprobs(lambda lps: lps[1:] + lps[-1:])
    return {}


def reload_leaves_attention_stale() -> dict:
    """A reload that updates every weight except the attention projections (part of the weights stale)."""
    def commit(self, new):
        for name, t in self.weights.items():
            if ".self_attn." not in name:
                t.copy_(new[name])
        self.model.prepare()
    Engine.commit_weights = commit
    return {}


def async_weight_swap() -> dict:
    """A reload that validates, answers success, and swaps the weights in later (3 s) in the background:
    requests sent after the reload answered are still served by the old weights."""
    def update(self, path):
        try:
            staged = self.stage_weights(path)
        except Exception as exc:  # noqa: BLE001
            return False, f"{type(exc).__name__}: {exc}"
        timer = threading.Timer(3.0, self.commit_weights, args=(staged,))
        timer.daemon = True
        timer.start()
        self.model_path = path
        self.weight_version += 1
        return True, f"Succeeded to update model weights from {path!r}."
    Engine.update_weights_from_disk = update
    return {}


def fp32_engine() -> dict:
    """Correct but different arithmetic: a GPU engine's rounding choices (tests/server/engine_variants.py)."""
    from tests.server.engine_variants import ENGINE_METHODS, Fp32EngineModel

    for name in ENGINE_METHODS:
        setattr(TinyModel, name, getattr(Fp32EngineModel, name))
    return {}


def dies_after_failed_reload() -> dict:
    """Answers a failed reload, then the whole server exits on the next generation (as vLLM 0.32's engine
    dies after one): the scenario suite must replace the server, not fail every later scenario on it."""
    update, generate = Engine.update_weights_from_disk, Engine.generate

    def failing_update(self, path):
        ok, message = update(self, path)
        self.doomed = getattr(self, "doomed", False) or not ok
        return ok, message

    def dying_generate(self, requests):
        if getattr(self, "doomed", False):
            os._exit(1)
        return generate(self, requests)
    Engine.update_weights_from_disk, Engine.generate = failing_update, dying_generate
    return {}


def accepts_damaged_block_scales() -> dict:
    """The loader checks names, dtypes, shapes and the global scales but not the E4M3 block scales (as before
    issue 37): a checkpoint with a NaN or negative block scale is loaded and served."""
    import reference_impl.model.architectures as arch
    from reference_impl.model.checkpoint import CheckpointError

    original = arch.check_tensors

    def check_tensors(tensors, specs, source="checkpoint"):
        try:
            original(tensors, specs, source)
        except CheckpointError as exc:
            if "block scale(s) that are NaN or negative" not in str(exc):
                raise
    arch.check_tensors = check_tensors
    return {}


MUTANTS = {f.__name__: f for f in (reload_keeps_old_weights, reload_drops_awq_scale, nondeterministic_reduction,
                                   drops_requests_during_reload, half_loaded_on_failure, batch_dependent_numerics,
                                   rebinding_reload, logprobs_truncated, logprobs_of_next_position,
                                   reload_leaves_attention_stale, async_weight_swap, fp32_engine,
                                   pause_aborts_in_flight_requests, dies_after_failed_reload, random_cobatching,
                                   random_cobatching_batch_variant, cobatch_variant_only, slow_3x, slows_down,
                                   drops_one_request, accepts_damaged_block_scales, large_prefill_drops_k_block,
                                   large_decode_batch_drops_k_block,
                                   large_batch_stale_after_reload, moe_expert_workspace_32,
                                   bucketed_reduction_order)}


def _patched_worker(mutant: str, rank: int, cfg) -> None:
    """Ranks 1..N-1 of a mutant server: the same patch, then the reference worker loop."""
    MUTANTS[mutant]()
    worker_main(rank, cfg)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--mutant" or argv[1] not in MUTANTS:
        raise SystemExit(f"usage: tests/server/mutants.py --mutant {{{','.join(MUTANTS)}}} SERVER_FLAGS")
    kwargs = MUTANTS[argv[1]]()
    return server_main(argv[2:], worker_target=functools.partial(_patched_worker, argv[1]), **kwargs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
