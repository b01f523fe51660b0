"""W4A16 fused-MoE backends with one planted bug each (mutants), and correct-but-different ones (variants).

Every mutant is named after its bug and declares the named check of :mod:`conformance.moe.checks` expected
to reject it (``caught_by``); every variant computes the contract by a different legal route and must pass.
They are built from :class:`KernelLayoutMoE`, which does what an engine integration does: turn the
checkpoint into FlashInfer's CuTe DSL kernel layout at prepare time ([up; gate] 64-row interleave, 128x4
swizzled scales in the MMA view, one GEMM1 alpha per expert), and at run time read that layout back the
way a kernel would and evaluate the experts (with :func:`reference_impl.moe.fused_moe_w4a16`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from conformance.interfaces.kernel import Backend, DenseLayer, MoEExperts
from conformance.adapters.flashinfer import moe as flashinfer_moe
from conformance.adapters.flashinfer.moe import KernelMoEWeights, build_kernel_layout, read_back_kernel_layout
from reference_impl.moe import fused_moe_w4a16
from reference_impl.format.nvfp4 import W13_CHUNK_ROWS


@dataclass(frozen=True)
class Prepared:
    layout: KernelMoEWeights
    experts: MoEExperts  # the checkpoint form (for metadata: rank, activation; and for input scales)


class KernelLayoutMoE(Backend):
    """A correct MoE through the kernel layout; stages are overridable hooks."""

    name = "KernelLayoutMoE"
    caught_by: str | None = None
    #: the conformance.moe.diagnosis rule(s) / cross-case pattern(s) its failures must show
    diagnosed_as: str | tuple[str, ...] | None = None
    build_chunk_rows = W13_CHUNK_ROWS
    read_chunk_rows = W13_CHUNK_ROWS

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.name = cls.__name__

    def prepare_dense(self, layer: DenseLayer, device: torch.device) -> Any:
        raise NotImplementedError("MoE-only test backend")

    def run_dense(self, prepared: Any, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("MoE-only test backend")

    # --- hooks
    def checkpoint_view(self, experts: MoEExperts) -> MoEExperts:
        """What the layout is built from (mutants doctor it)."""
        return experts

    def prepare_moe(self, experts: MoEExperts, device: torch.device) -> Prepared:
        layout = build_kernel_layout(self.checkpoint_view(experts), device, self.build_chunk_rows)
        return Prepared(layout, experts)

    def decoded(self, prepared: Prepared) -> MoEExperts:
        return read_back_kernel_layout(prepared.layout, prepared.experts, self.read_chunk_rows)

    def routing(self, prepared: Prepared, ids: torch.Tensor, w: torch.Tensor):
        return ids, w

    def evaluate(self, x, ids, w, experts: MoEExperts) -> torch.Tensor:
        return fused_moe_w4a16(x, ids, w, experts)

    def run_moe(self, prepared: Prepared, x, topk_ids, topk_weights) -> torch.Tensor:
        experts = self.decoded(prepared)
        experts = replace(experts, w13=experts.w13.to(x.device), w13_scale=experts.w13_scale.to(x.device),
                          w13_scale_2=experts.w13_scale_2.to(x.device), w2=experts.w2.to(x.device),
                          w2_scale=experts.w2_scale.to(x.device), w2_scale_2=experts.w2_scale_2.to(x.device))
        ids, w = self.routing(prepared, topk_ids, topk_weights)
        return self.evaluate(x, ids, w, experts)

    def skip_reason(self, case) -> str | None:
        if "untied_gate_up_general" in case.features:
            return "one GEMM1 alpha per expert: no exact fold for a non-power-of-two gate/up scale ratio"
        return None


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    half = t.shape[1] // 2
    return torch.cat([t[:, half:], t[:, :half]], dim=1)


# ----------------------------------------------------------------------------------------- mutants
class GateUpSwapped(KernelLayoutMoE):
    """Loads W13 as [up; gate] and then applies the kernel interleave: gate and up change places."""

    caught_by = "moe_within_bound"
    diagnosed_as = "gate_up_swapped"

    def checkpoint_view(self, experts):
        return replace(experts, w13=_swap_halves(experts.w13), w13_scale=_swap_halves(experts.w13_scale),
                       w13_scale_2=experts.w13_scale_2.flip(1))


class Interleave32Rows(KernelLayoutMoE):
    """Builds the 64-row [up; gate] interleave but the kernel reads it in 32-row chunks."""

    caught_by = "moe_within_bound"
    read_chunk_rows = 32


class InputScaleFoldedIntoAlpha(KernelLayoutMoE):
    """Uses the W4A4 alphas under W4A16: ``input_scale * weight_scale_2`` (engines scalarize the input scale)."""

    caught_by = "moe_within_bound"
    diagnosed_as = "w4a4_alpha"

    def checkpoint_view(self, experts):
        if experts.w13_input_scale is None:
            return experts
        a1 = experts.w13_input_scale.max().float()
        a2 = experts.w2_input_scale.max().float()
        return replace(experts, w13_scale_2=experts.w13_scale_2 * a1, w2_scale_2=experts.w2_scale_2 * a2)


class RoutingWeightsIgnored(KernelLayoutMoE):
    """Sums the experts' outputs without the routing weights."""

    caught_by = "moe_within_bound"
    diagnosed_as = "routing_weights_ignored"

    def routing(self, prepared, ids, w):
        return ids, torch.ones_like(w)


class ExpertOffsetIgnored(KernelLayoutMoE):
    """Treats global ids as local ids on every rank (local_expert_offset = 0)."""

    caught_by = "moe_within_bound"
    diagnosed_as = ("expert_offset_ignored", "expert_parallel_only")

    def decoded(self, prepared):
        return replace(super().decoded(prepared), ep_rank=0)


class ActivationOnUpHalf(KernelLayoutMoE):
    """Applies the nonlinearity to the up half: silu(up) * gate."""

    caught_by = "moe_within_bound"
    diagnosed_as = "gate_up_swapped"

    def decoded(self, prepared):
        ex = super().decoded(prepared)
        if ex.activation == "relu2":
            return ex
        return replace(ex, w13=_swap_halves(ex.w13), w13_scale=_swap_halves(ex.w13_scale),
                       w13_scale_2=ex.w13_scale_2.flip(1))


class LastExpertDropped(KernelLayoutMoE):
    """An off-by-one in the expert loop: the rank's last local expert never runs."""

    caught_by = "moe_within_bound"
    diagnosed_as = "one_expert_wrong"

    def routing(self, prepared, ids, w):
        ex = prepared.experts
        last = (ex.ep_rank + 1) * ex.num_local_experts - 1
        return torch.where(ids.long() == last, torch.full_like(ids, -1), ids), w


class GateScaleForBothHalves(KernelLayoutMoE):
    """SGLang 0.5.23's CuTe DSL path: ``w13_weight_scale_2[:, 0]`` (gate) as the alpha of both halves."""

    caught_by = "moe_within_bound"
    diagnosed_as = ("gate_scale_for_up", "untied_gate_up_only")

    def skip_reason(self, case):
        return None

    def checkpoint_view(self, experts):
        gate = experts.w13_scale_2[:, :1]
        return replace(experts, w13_scale_2=torch.cat([gate, gate], dim=1))


class NondeterministicCombine(KernelLayoutMoE):
    """Switches the combine between calls (an autotuner picking another tactic per call): the fp32 combine,
    then bf16 per-slot sums, alternately. Each result alone is within the bound; they differ bitwise.
    (Alternating, not random, so the self-test cannot be flaky.)"""

    caught_by = "moe_deterministic"
    diagnosed_as = "nondeterministic_combine"
    _calls = 0

    def evaluate(self, x, ids, w, experts):
        self._calls += 1
        if self._calls % 2:
            return fused_moe_w4a16(x, ids, w, experts)
        out = torch.zeros(x.shape, dtype=torch.bfloat16, device=x.device)
        for k in range(ids.shape[1]):
            out = out + fused_moe_w4a16(x, ids[:, k : k + 1], w[:, k : k + 1], experts)
        return out


class Float32Output(KernelLayoutMoE):
    """Returns the fp32 accumulator instead of bfloat16."""

    caught_by = "moe_output_contract"

    def evaluate(self, x, ids, w, experts):
        return fused_moe_w4a16(x, ids, w, experts, out_dtype=torch.float32)


class DuplicateIdsCountedOnce(KernelLayoutMoE):
    """Deduplicates a token's expert ids (a set of experts per token): the second slot naming the same expert is
    dropped with its weight, instead of adding to the first."""

    caught_by = "moe_within_bound"
    diagnosed_as = ("duplicates_counted_once", "duplicate_ids_only")

    def routing(self, prepared, ids, w):
        ids = ids.clone()
        for k in range(1, ids.shape[1]):
            seen = (ids[:, k : k + 1] == ids[:, :k]).any(dim=1)
            ids[:, k] = torch.where(seen & (ids[:, k] >= 0), torch.full_like(ids[:, k], -1), ids[:, k])
        return ids, w


class PaddingIdWrapsToLastExpert(KernelLayoutMoE):
    """Indexes experts with the raw id, so -1 wraps around to the last global expert (Python/torch negative
    indexing) and the padded slot is computed with its garbage weight."""

    caught_by = "moe_within_bound"
    diagnosed_as = "padding_slots"

    def routing(self, prepared, ids, w):
        e = prepared.experts.num_global_experts or prepared.experts.num_local_experts
        return torch.where(ids < 0, ids + e, ids), w


class PaddingSlotMaskedByZeroWeight(KernelLayoutMoE):
    """Masks a -1 slot by sending it to expert 0 with its weight multiplied by 0: the weight is read (NaN * 0 is
    NaN), although a skipped slot's weight must never be read."""

    caught_by = "moe_within_bound"
    diagnosed_as = "padding_slots"

    def routing(self, prepared, ids, w):
        offset = prepared.experts.ep_rank * prepared.experts.num_local_experts
        skipped = ids < 0
        return torch.where(skipped, torch.full_like(ids, offset), ids), torch.where(skipped, w * 0.0, w)


class PaddingIdEndsTheTokensList(KernelLayoutMoE):
    """Treats -1 as the end of a token's list: the slots after the first -1 are dropped too."""

    caught_by = "moe_within_bound"
    diagnosed_as = ("padding_slots", "padding_ids_only")

    def routing(self, prepared, ids, w):
        after = torch.cumsum((ids < 0).int(), dim=1) > 0
        return torch.where(after, torch.full_like(ids, -1), ids), w


class TopkWeightsRenormalized(KernelLayoutMoE):
    """Renormalizes the top-k weights to sum to 1 (assumes a renormalizing router): wrong for routers that do not
    (plain softmax top-k, DeepSeek's routed_scaling_factor)."""

    caught_by = "moe_within_bound"
    diagnosed_as = "weights_renormalized"

    def routing(self, prepared, ids, w):
        valid = ids >= 0
        total = torch.where(valid, w, torch.zeros_like(w)).sum(dim=1, keepdim=True)
        return ids, torch.where(valid, w / total, w)


class Fp16HiddenStates(KernelLayoutMoE):
    """Converts the BF16 hidden states to FP16 and back before the experts (an FP16 MoE kernel reused)."""

    caught_by = "moe_within_bound"
    diagnosed_as = ("fp16_hidden", "fp16_range_only")

    def evaluate(self, x, ids, w, experts):
        return fused_moe_w4a16(x.half().to(torch.bfloat16), ids, w, experts)


class UnroutedRowsNotZeroed(KernelLayoutMoE):
    """Rows of tokens with no expert on this rank keep the input (a residual buffer reused as output) instead of
    zero, so the expert-parallel all-reduce adds garbage."""

    caught_by = "moe_within_bound"
    diagnosed_as = "unrouted_rows"

    def evaluate(self, x, ids, w, experts):
        out = fused_moe_w4a16(x, ids, w, experts)
        offset = experts.ep_rank * experts.num_local_experts
        local = ((ids.long() >= offset) & (ids.long() < offset + experts.num_local_experts)).any(dim=1)
        return torch.where(local.view(-1, 1), out, x)


MUTANTS = (
    GateUpSwapped, Interleave32Rows, InputScaleFoldedIntoAlpha, RoutingWeightsIgnored, ExpertOffsetIgnored,
    ActivationOnUpHalf, LastExpertDropped, GateScaleForBothHalves, NondeterministicCombine, Float32Output,
    DuplicateIdsCountedOnce, PaddingIdWrapsToLastExpert, PaddingSlotMaskedByZeroWeight, PaddingIdEndsTheTokensList,
    TopkWeightsRenormalized, Fp16HiddenStates, UnroutedRowsNotZeroed,
)


# ----------------------------------------------------------------------------------------- variants
class ExpertsInReverseOrder(KernelLayoutMoE):
    """Visits the local experts last to first (different fp32 summation order)."""

    def evaluate(self, x, ids, w, experts):
        order = list(range(experts.num_local_experts))[::-1]
        return fused_moe_w4a16(x, ids, w, experts, expert_order=order)


class TokensRegrouped(KernelLayoutMoE):
    """Processes the tokens in a shuffled order, in groups of 5, and scatters the rows back."""

    def evaluate(self, x, ids, w, experts):
        perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(7)).to(x.device)
        out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
        for chunk in perm.split(5):
            out[chunk] = fused_moe_w4a16(x[chunk], ids[chunk], w[chunk], experts)
        return out


class PerSlotBf16Combine(KernelLayoutMoE):
    """Rounds every expert contribution to bf16 and sums slots in bf16 in a fixed order (what the fused
    finalize does, made deterministic): legal, within the derived bound."""

    def evaluate(self, x, ids, w, experts):
        out = torch.zeros(x.shape, dtype=torch.bfloat16, device=x.device)
        for k in range(ids.shape[1]):
            out = out + fused_moe_w4a16(x, ids[:, k : k + 1], w[:, k : k + 1], experts)
        return out


class DuplicateSlotsMerged(KernelLayoutMoE):
    """Merges slots naming the same expert into one with the summed weight (``w1 E(x) + w2 E(x) = (w1 + w2) E(x)``,
    one expert evaluation instead of two): the duplicate contract, computed another way."""

    def routing(self, prepared, ids, w):
        ids, w = ids.clone(), w.clone()
        for k in range(1, ids.shape[1]):
            for j in range(k):
                same = (ids[:, k] == ids[:, j]) & (ids[:, j] >= 0)
                w[:, j] = torch.where(same, w[:, j] + w[:, k], w[:, j])
                ids[:, k] = torch.where(same, torch.full_like(ids[:, k], -1), ids[:, k])
        return ids, w


class FlashInferAdapterOnEmulator(Backend):
    """The real FlashInfer adapter (:mod:`conformance.adapters.flashinfer.moe`) driving the pure-PyTorch
    ``CuteDslMoEWrapper`` emulator (:mod:`reference_impl.flashinfer_emulator`) instead of the GPU kernel:
    checks the adapter's layout, alphas, offsets and arguments on CPU."""

    name = "FlashInferAdapterOnEmulator"

    def prepare_dense(self, layer, device):
        raise NotImplementedError("MoE-only test backend")

    def run_dense(self, prepared, x):
        raise NotImplementedError("MoE-only test backend")

    def skip_reason(self, case):
        reason = flashinfer_moe.flashinfer_moe_skip_reason(case, torch.device("cuda"))
        static = ("intermediate %", "non-power-of-two")  # shape/scale reasons apply on any device
        return reason if reason and any(s in reason for s in static) else None

    def prepare_moe(self, experts, device):
        from reference_impl import flashinfer_emulator as emu

        return flashinfer_moe.prepare_moe(experts, device, wrapper_source=lambda: (emu.CuteDslMoEWrapper, emu.ActivationType))

    def run_moe(self, prepared, x, topk_ids, topk_weights):
        return flashinfer_moe.run_moe(prepared, x, topk_ids, topk_weights)


VARIANTS = (KernelLayoutMoE, ExpertsInReverseOrder, TokensRegrouped, PerSlotBf16Combine, DuplicateSlotsMerged,
            FlashInferAdapterOnEmulator)
