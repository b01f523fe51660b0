"""The per-rank engine of the reference server: weights, the model, generation, atomic reload, memory
occupation state. Every rank runs the same commands in the same order (rank 0 broadcasts them, see
:mod:`.parallel`), so collectives inside the model line up.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from reference_impl.model.checkpoint import load_checkpoint
from reference_impl.model import Comm, Layout, ModelConfig, TinyModel, shard_weights, validate_checkpoint
from reference_impl.server.logprobs import InputLogprobs, LogprobRequest, Pairs, position_extras, score_prompt

SAMPLING_EPS = 1e-6  # SGLang's rule, applied to every API: a temperature below this is greedy

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens (SGLang's penalizer)
    min_p: float = 0.0


@dataclass(frozen=True)
class GenerateRequest:
    input_ids: tuple[int, ...]
    params: SamplingParams
    logprobs: LogprobRequest = LogprobRequest()


@dataclass
class GenerateResult:
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: dict | None = None
    top_logprobs: list[Pairs | None] = field(default_factory=list)
    token_ids_logprobs: list[Pairs | None] = field(default_factory=list)
    input_logprobs: InputLogprobs | None = None


class EngineError(RuntimeError):
    """A command the engine refuses in its current state (reported to the client as a 4xx)."""


class Engine:
    """One rank's state. ``dp_rank``/``dp_size``: which data-parallel group this rank serves; requests
    ``i`` with ``i % dp_size == dp_rank`` are computed by that group."""

    def __init__(self, model_path: str, layout: Layout, comm: Comm, device: str = "cpu",
                 dp_rank: int = 0, dp_size: int = 1, world_agree=None):
        self.layout, self.comm, self.device = layout, comm, device
        self.dp_rank, self.dp_size = dp_rank, dp_size
        # world_agree(ok: bool) -> bool: True iff every rank says ok (identity on one rank)
        self._agree = world_agree or (lambda ok: ok)
        self.released: set[str] = set()
        self.offloaded: dict[str, torch.Tensor] | None = None  # CPU copy of released weights (vLLM sleep level 1)
        ckpt = load_checkpoint(model_path)
        self.cfg: ModelConfig = validate_checkpoint(ckpt)
        self.model_path = model_path
        self.weights = shard_weights(self.cfg, ckpt.tensors, layout, device)
        self.model = TinyModel(self.cfg, self.weights, comm)
        self.weight_version = 0

    # ------------------------------------------------------------------ weights
    def stage_weights(self, path: str) -> dict[str, torch.Tensor]:
        """Read, validate and shard a checkpoint without touching the served weights."""
        ckpt = load_checkpoint(path)
        cfg = validate_checkpoint(ckpt)
        if cfg != self.cfg:
            raise EngineError(f"checkpoint {path!r} has a different model config than the one being served")
        staged = shard_weights(cfg, ckpt.tensors, self.layout, self.device)
        if staged.keys() != self.weights.keys():  # e.g. an AWQ scale present in one, folded away in the other
            diff = sorted(staged.keys() ^ self.weights.keys())
            raise EngineError(f"checkpoint {path!r} holds a different set of tensors than the one being served "
                              f"({len(diff)} differ, e.g. {diff[:3]})")
        return staged

    def commit_weights(self, new: dict[str, torch.Tensor]) -> None:
        """Copy staged weights into the served tensors (same objects, same storage: what captured
        graphs would hold), then re-derive prepared state."""
        for name, t in self.weights.items():
            t.copy_(new[name])
        self.model.prepare()

    def update_weights_from_disk(self, path: str) -> tuple[bool, str]:
        """Atomic reload: every rank stages; only if all succeed does any rank commit."""
        staged, message = None, ""
        if "weights" in self.released:
            message = "weights are released; resume_memory_occupation(tags=['weights']) first"
        else:
            try:
                staged = self.stage_weights(path)
            except Exception as exc:  # noqa: BLE001 - any failure must leave the old weights serving
                message = f"{type(exc).__name__}: {exc}"
        if not self._agree(staged is not None):
            return False, f"failed to load weights from {path!r}, old weights kept. {message}".strip()
        self.commit_weights(staged)
        self.model_path = path
        self.weight_version += 1
        return True, f"Succeeded to update model weights from {path!r}."

    # ------------------------------------------------------------------ memory occupation
    @staticmethod
    def _tags(tags) -> list[str]:
        tags = list(MEMORY_TAGS) if tags is None else list(tags)
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if unknown:
            raise EngineError(f"unknown memory tags {unknown}; known: {list(MEMORY_TAGS)}")
        return tags

    def release_memory_occupation(self, tags, offload_weights: bool = False) -> None:
        """``offload_weights``: keep a CPU copy of the weights, restored on resume (vLLM's sleep level 1);
        otherwise released weights come back zeroed, as SGLang's without CPU backup (and vLLM's level 2)."""
        tags = self._tags(tags)
        if offload_weights and "weights" in tags and "weights" not in self.released:
            self.offloaded = {k: t.to("cpu", copy=True) for k, t in self.weights.items()}
        self.released.update(tags)

    def resume_memory_occupation(self, tags) -> None:
        for tag in self._tags(tags):
            if tag == "weights" and tag in self.released:
                for name, t in self.weights.items():
                    if self.offloaded is not None:
                        t.copy_(self.offloaded[name])
                    else:  # released memory comes back without its contents: reload from disk next
                        t.zero_()
                self.offloaded = None
                self.model.prepare()
            self.released.discard(tag)

    # ------------------------------------------------------------------ generation
    def _choose(self, logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
        if p.temperature < SAMPLING_EPS or p.top_k == 1:  # one rule for every API (a tiny temperature would
            return int(torch.argmax(logits))               # overflow logits / temperature to inf)
        probs = torch.softmax(logits / p.temperature, dim=-1)
        if p.top_k > 0:
            kth = torch.topk(probs, min(p.top_k, probs.numel())).values[-1]
            probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = (sorted_p.cumsum(0) - sorted_p) < p.top_p * sorted_p.sum()
            keep[0] = True  # the most likely token always stays (a top_p too small to keep any, e.g. 5e-324)
            mask = torch.zeros_like(probs, dtype=torch.bool)
            mask[order[keep]] = True
            probs = torch.where(mask, probs, torch.zeros_like(probs))
        if p.min_p > 0.0:  # relative to the most likely token, as SGLang and vLLM define it
            probs = torch.where(probs >= p.min_p * probs.max(), probs, torch.zeros_like(probs))
        probs = probs.cpu()  # the seeded generator lives on the CPU: sample there, on every device alike
        return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))

    def generate(self, requests: list[GenerateRequest]) -> dict[int, GenerateResult]:
        """Results of the requests this rank's data-parallel group serves, keyed by request index."""
        if self.released & {"weights", "kv_cache"}:
            raise EngineError(f"memory occupation released ({sorted(self.released)}); resume it before generating")
        mine = [i for i in range(len(requests)) if i % self.dp_size == self.dp_rank]
        results = {i: GenerateResult() for i in mine}
        gens = {i: torch.Generator().manual_seed(requests[i].params.seed) if requests[i].params.seed is not None
                else None for i in mine}
        for i, scored in self._score_prompts(requests, mine).items():
            results[i].input_logprobs = scored
        steps = max((r.params.max_new_tokens for r in requests), default=0)
        for _ in range(steps):
            active = [i for i in mine if results[i].finish_reason is None]
            if not self._any_active(bool(active)):
                break
            seqs = [torch.tensor(list(requests[i].input_ids) + results[i].output_ids, dtype=torch.long,
                                 device=self.device) for i in active]
            logits = self.model.last_logits(seqs) if seqs or self._needs_lockstep() else None
            if not active:
                continue
            logprobs = torch.log_softmax(logits, dim=-1)
            for row, i in enumerate(active):
                p, res = requests[i].params, results[i]
                step_logits = logits[row]
                if len(res.output_ids) < p.min_new_tokens:
                    step_logits = step_logits.clone()
                    step_logits[[self.cfg.eos_token_id, *p.stop_token_ids]] = float("-inf")
                tok = self._choose(step_logits, p, gens[i])
                res.output_ids.append(tok)
                res.logprobs.append(float(logprobs[row, tok]))
                if requests[i].logprobs.top_k or requests[i].logprobs.token_ids is not None:
                    top, named = position_extras(logprobs[row], requests[i].logprobs)
                    res.top_logprobs.append(top)
                    res.token_ids_logprobs.append(named)
                if not p.ignore_eos and (tok == self.cfg.eos_token_id or tok in p.stop_token_ids):
                    res.finish_reason = {"type": "stop", "matched": tok}
                elif len(res.output_ids) >= p.max_new_tokens:
                    res.finish_reason = {"type": "length", "length": p.max_new_tokens}
        for res in results.values():
            if res.finish_reason is None:
                res.finish_reason = {"type": "length", "length": len(res.output_ids)}
        return results

    def _score_prompts(self, requests: list[GenerateRequest], mine: list[int]) -> dict[int, InputLogprobs]:
        """Prompt logprobs of the requests that ask for them, from one extra forward over their prompts
        (every data-parallel group joins it when any group needs it: its collectives span all ranks)."""
        wanted = [i for i in mine if requests[i].logprobs.wants_input(len(requests[i].input_ids))]
        if not self._any_active(bool(wanted)):
            return {}
        seqs = [torch.tensor(requests[i].input_ids, dtype=torch.long, device=self.device) for i in wanted]
        logprobs = torch.log_softmax(self.model.logits(seqs), dim=-1)
        out, start = {}, 0
        for i, seq in zip(wanted, seqs):
            out[i] = score_prompt(logprobs[start:start + seq.numel()], requests[i].input_ids, requests[i].logprobs)
            start += seq.numel()
        return out

    def _needs_lockstep(self) -> bool:
        """Ranks of other data-parallel groups may be mid-forward: join the collectives with no tokens."""
        return self.dp_size > 1

    def _any_active(self, local: bool) -> bool:
        return not self._agree(not local) if self.dp_size > 1 else local
