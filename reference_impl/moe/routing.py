"""MoE routers: router logits -> top-k global expert ids and fp32 routing weights.

These are the usual routers of open MoE models, written from their definitions so that MoE cases can
start from logits instead of hand-made ids:

* :func:`softmax_topk` -- softmax over all experts, keep the ``top_k`` largest probabilities, optionally
  renormalize them to sum to 1 (Mixtral/Qwen-MoE style with ``renormalize=True``, the "plain" variant
  without).
* :func:`sigmoid_topk_with_bias` -- DeepSeek-V3 style: per-expert sigmoid scores, the expert *choice*
  uses ``score + correction_bias`` while the *weights* are the unbiased scores of the chosen experts,
  renormalized and multiplied by ``routed_scaling_factor``; with ``n_group`` / ``topk_group`` the choice is
  restricted to the ``topk_group`` groups (of ``n_group`` contiguous experts) whose two best biased scores
  sum highest (DeepSeek-V3's ``noaux_tc``).

Ids are int32 (what fused-MoE kernels take), weights float32. Ties between equal scores are broken
by ``torch.topk`` (lowest index first on CPU); cases use continuous random logits so ties do not occur.
"""
from __future__ import annotations

import torch


def _check_logits(logits: torch.Tensor, top_k: int) -> None:
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k = {top_k} must be in [1, num_experts = {logits.shape[1]}]")


def softmax_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing. Softmax is taken in fp32 over all experts; with ``renormalize`` the kept
    probabilities are divided by their sum (so they sum to 1), otherwise they are used as they are."""
    _check_logits(logits, top_k)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), weights.float()


def sigmoid_topk_with_bias(
    logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    n_group: int = 1,
    topk_group: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid routing with a score-correction bias (DeepSeek-V3's ``e_score_correction_bias``):
    choose by ``sigmoid(logits) + bias`` among the experts of the ``topk_group`` best groups
    (:func:`allowed_by_groups`), weigh by ``sigmoid(logits)`` of the chosen experts."""
    _check_logits(logits, top_k)
    if correction_bias.shape != (logits.shape[1],):
        raise ValueError(f"correction bias shape {tuple(correction_bias.shape)} != ({logits.shape[1]},)")
    scores = torch.sigmoid(logits.float())
    choice = scores + correction_bias.float()
    allowed = allowed_by_groups(choice, n_group, topk_group)
    _, ids = torch.topk(choice.masked_fill(~allowed, float("-inf")), top_k, dim=-1)
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), (weights * routed_scaling_factor).float()


def group_scores(choice: torch.Tensor, n_group: int) -> torch.Tensor:
    """``[T, n_group]``: the sum of the two best biased scores of each group of contiguous experts."""
    t, e = choice.shape
    if e % n_group:
        raise ValueError(f"{e} experts cannot form {n_group} equal groups")
    per = choice.view(t, n_group, e // n_group)
    return per.topk(min(2, e // n_group), dim=-1).values.sum(-1)


def allowed_by_groups(choice: torch.Tensor, n_group: int, topk_group: int,
                      groups: torch.Tensor | None = None) -> torch.Tensor:
    """``[T, E]`` bool: the experts of the ``topk_group`` best groups (or of the given ``groups [T, g]``)."""
    t, e = choice.shape
    if n_group <= 1 or topk_group >= n_group:
        return torch.ones_like(choice, dtype=torch.bool)
    if groups is None:
        groups = torch.topk(group_scores(choice, n_group), topk_group, dim=-1).indices
    mask = torch.zeros(t, n_group, dtype=torch.bool, device=choice.device).scatter_(1, groups, True)
    return mask.repeat_interleave(e // n_group, dim=1)


def route_all_to_one(
    num_tokens: int, top_k: int, expert: int, num_experts: int, device="cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token to ``expert`` in slot 0; the other slots (if any) to the next experts (mod
    ``num_experts``), weights ``1/top_k`` each -- the "every token to one expert" load pattern."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k = {top_k} must be in [1, num_experts = {num_experts}]")
    slots = (torch.arange(top_k, device=device) + expert) % num_experts
    ids = slots.to(torch.int32).expand(num_tokens, top_k).contiguous()
    weights = torch.full((num_tokens, top_k), 1.0 / top_k, dtype=torch.float32, device=device)
    return ids, weights


# ------------------------------------------------------------ routing variants the MoE cases are built with
def duplicate_slots(ids: torch.Tensor, w: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Half the tokens name their first expert again in their last slot (every slot keeps its own weight; with
    top-k >= 4 a quarter also in slot 1: three times). Both slots count (docs/moe.md)."""
    ids = ids.clone()
    t = ids.shape[0]
    again = torch.rand(t, generator=g, device=ids.device) < 0.5
    ids[:, -1] = torch.where(again, ids[:, 0], ids[:, -1])
    if ids.shape[1] >= 4:
        thrice = again & (torch.rand(t, generator=g, device=ids.device) < 0.5)
        ids[:, 1] = torch.where(thrice, ids[:, 0], ids[:, 1])
    return ids, w


def padding_slots(ids: torch.Tensor, w: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A quarter of the slots and every 8th token entirely (a padded row) get id -1; their weights are NaN,
    standing for the uninitialised memory engines leave there (a skipped slot's weight is never read)."""
    skipped = torch.rand(ids.shape, generator=g, device=ids.device) < 0.25
    skipped |= (torch.arange(ids.shape[0], device=ids.device) % 8 == 7).view(-1, 1)
    ids = torch.where(skipped, torch.full_like(ids, -1), ids)
    w = torch.where(skipped, torch.full_like(w, float("nan")), w)
    return ids, w
