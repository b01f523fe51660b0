"""Scheduling and pace stand-ins for the server scenarios (issue 39): servers that co-batch concurrent requests at
random (batch invariant or not), slow down, or lose a request. Registered in tests/server/mutants.py's ``MUTANTS``
(run them through that script); tests/server/test_server_pacing.py and test_server_mutants.py use them.
"""
from __future__ import annotations

import random
import time

from reference_impl.model import TinyModel
from reference_impl.server.app import Scheduler

CALIBRATION_REQUESTS = 3  # the suite's first generate requests to a new server: fresh outputs, calibration, probe
_JOBS_IN_FORWARD = [1]  # how many requests share the forward now running (read by the batch-variant patches)


class _RandomCobatchingScheduler(Scheduler):
    """Co-batches queued requests only when a coin says so (as a continuous-batching engine does depending on
    timing): whether two concurrent requests share a forward is luck, different on every run."""

    def _next_batch(self):
        batch = super()._next_batch()
        if len(batch) > 1 and random.random() < 0.5:
            with self._cv:  # put the rest back, in order: they run in later forwards
                for job in reversed(batch[1:]):
                    self._jobs.appendleft(job)
            batch = batch[:1]
        return batch

    def run_generate(self, batch):
        _JOBS_IN_FORWARD[0] = len(batch)
        try:
            super().run_generate(batch)
        finally:
            _JOBS_IN_FORWARD[0] = 1


def _perturb_logits(when) -> None:
    original = TinyModel.last_logits

    def last_logits(self, seqs):
        out = original(self, seqs)
        return out * (1.0 + 2.0 ** -10) if when(seqs) else out
    TinyModel.last_logits = last_logits


def random_cobatching() -> dict:
    """Correct and batch invariant; co-batches concurrent requests at random. Must pass every run."""
    return {"scheduler_cls": _RandomCobatchingScheduler}


def random_cobatching_batch_variant() -> dict:
    """Co-batches concurrent requests at random, and a forward of several sequences (an explicit batch or
    co-batched requests) computes other logits than one alone. Must fail every run."""
    _perturb_logits(lambda seqs: len(seqs) > 1)
    return {"scheduler_cls": _RandomCobatchingScheduler}


def cobatch_variant_only() -> dict:
    """Explicit batches are batch invariant; only co-batched concurrent requests (several requests in one
    forward, at random) compute other logits: visible only when the scheduler happens to co-batch."""
    _perturb_logits(lambda seqs: _JOBS_IN_FORWARD[0] > 1)
    return {"scheduler_cls": _RandomCobatchingScheduler}


class _CountingScheduler(Scheduler):
    generate_jobs = 0

    def _next_batch(self):
        batch = super()._next_batch()
        return [job for job in batch if self._admit(job)]

    def _admit(self, job) -> bool:
        if job.kind == "generate":
            type(self).generate_jobs += 1
        return True


class _SlowScheduler(_CountingScheduler):
    """After the calibration requests every forward is slowed: by ``factor`` x its compute time, or by a fixed
    ``sleep_s``. Always answers."""

    factor, sleep_s = 1.0, 0.0

    def run_generate(self, batch):
        start = time.monotonic()
        super().run_generate(batch)
        if type(self).generate_jobs > CALIBRATION_REQUESTS:
            time.sleep((self.factor - 1.0) * (time.monotonic() - start) + self.sleep_s)


def slow_3x() -> dict:
    """Every request after the calibration takes 3x its compute time. Must pass."""
    return {"scheduler_cls": type("Slow3x", (_SlowScheduler,), {"factor": 3.0})}


def slows_down() -> dict:
    """After the calibration every forward takes 1 s more (a server whose machine got loaded): requests take
    far longer than their calibrated limit, and so do the probes. Must pass: slow, not lost."""
    return {"scheduler_cls": type("SlowsDown", (_SlowScheduler,), {"sleep_s": 1.0})}


class _DroppingOneScheduler(_CountingScheduler):
    """Every 4th generate request after the calibration is never answered (its job forgotten); the others,
    /health and the probes are served as usual."""

    def _admit(self, job) -> bool:
        super()._admit(job)
        n = type(self).generate_jobs
        return not (job.kind == "generate" and n > CALIBRATION_REQUESTS and (n - CALIBRATION_REQUESTS) % 4 == 0)

    def _next_batch(self):
        while True:  # a batch whose every job was dropped: wait for the next
            batch = super()._next_batch()
            if batch or self._stop:
                return batch


def drops_one_request() -> dict:
    """Loses one request in four after the calibration (never answers it). Must fail with "request lost"."""
    return {"scheduler_cls": _DroppingOneScheduler}
