"""Deliberately broken reference servers (and one correct-but-different one) for the server scenarios.

    python tests/mutant_servers.py --mutant NAME --model-path DIR --port P [server flags]

Each mutant patches one behaviour of the reference server (single rank) and must be rejected by the named
scenario in tests/test_server_mutants.py; ``rebinding_reload`` is correct and must be accepted.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from reference_impl.checkpoint import load_checkpoint  # noqa: E402
from reference_impl.model import TinyModel  # noqa: E402
from reference_impl.server.__main__ import launch, parse_args  # noqa: E402
from reference_impl.server.app import Scheduler  # noqa: E402
from reference_impl.server.engine import Engine, GenerateResult  # noqa: E402
from reference_impl.server.parallel import RankRuntime  # noqa: E402


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


MUTANTS = {f.__name__: f for f in (reload_keeps_old_weights, reload_drops_awq_scale, nondeterministic_reduction,
                                   drops_requests_during_reload, half_loaded_on_failure, batch_dependent_numerics,
                                   rebinding_reload)}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--mutant" or argv[1] not in MUTANTS:
        raise SystemExit(f"usage: mutant_servers.py --mutant {{{','.join(MUTANTS)}}} SERVER_FLAGS")
    args = parse_args(argv[2:])
    if args.tp != 1:
        raise SystemExit("mutant servers run a single rank (--tp 1): patches do not reach spawned ranks")
    launch(args, RankRuntime, **MUTANTS[argv[1]]())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
