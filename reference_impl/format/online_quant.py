"""Online quantization of BF16 MoE experts at load time (an engine's ``nvfp4_online`` mode).

SGLang 0.5.23 (``srt/layers/quantization/nvfp4_online.py``) quantizes each expert as it is loaded:

* ``w2`` (down) alone; ``w1`` (gate) and ``w3`` (up) *together* (``torch.cat([gate, up])``), so the pair
  shares one amax-derived ``weight_scale_2 = amax / (6 * 448)`` (1.0 for an all-zero tensor), as
  serialized NVFP4 checkpoints do -- ``w13_weight_scale_2[:, 0] == w13_weight_scale_2[:, 1]``;
* the codes and block scales come from FlashInfer's ``nvfp4_quantize(w, 1 / weight_scale_2,
  backend="cute-dsl", nvfp4_4over6=NVFP44Over6Config(e4m3_max=448, err_mode="MSE",
  err_use_fast_math=True))``: the **4over6** recipe, which for every 16-element block tries two block
  scales -- the block max mapped to 6 (the standard recipe) and to 4 (scale x 1.5) -- and keeps the
  candidate with the smaller squared error (ties keep 6).

So the engine's online codes are NOT the ModelOpt recipe's: they agree on every block where the
6-candidate wins and the two scale formulas round alike, and differ elsewhere. The stated, bounded
difference: both are round-to-nearest quantizations at their block's scale, so each element of either
is within ``reference_impl.bounds.moe.quantization_error_bound`` of the BF16 weight (and the two within
the sum of their bounds). :func:`quantize_4over6` models the recipe with exact fp32 arithmetic
(FlashInfer's ``DISABLE_FP4_QUANT_FAST_MATH`` order); the fast-math variant SGLang selects evaluates the
candidate errors in lower precision and may pick the other candidate on near-ties -- not bit-verified here.
"""
from __future__ import annotations

import torch

from reference_impl.moe import ExpertWeights
from reference_impl.format.nvfp4 import (
    E2M1_MAX,
    E4M3_MAX,
    FLOAT32_MAX,
    NVFP4Weight,
    _block_amax,
    _blocks,
    dequantize,
    e2m1_decode,
    e2m1_encode,
    e4m3_encode,
    pack_nibbles,
    quantize_modelopt,
)

RECIPES = ("modelopt", "4over6")


def online_weight_scale_2(w: torch.Tensor) -> torch.Tensor:
    """SGLang online's decode scale: ``amax / (448 * 6)`` in fp32, 1.0 when the tensor is all zero."""
    amax = torch.nan_to_num(w.float().abs(), nan=0.0).amax()
    return torch.where(amax > 0, amax / (E4M3_MAX * E2M1_MAX), torch.ones_like(amax))


def quantize_4over6(w: torch.Tensor, weight_scale_2: torch.Tensor | float) -> NVFP4Weight:
    """The 4over6 (MSE) recipe with exact fp32 arithmetic: per block ``sf6 = e4m3((amax/6) * gs)``,
    ``sf4 = e4m3((amax/6) * gs * 1.5)`` with ``gs = 1/weight_scale_2``; each candidate quantizes with
    ``inv = min(1 / (sf * (1/gs)), FLT_MAX)``; the block keeps the 4-candidate iff its summed squared
    dequantization error is strictly smaller. All-zero blocks get scale 0 and codes 0."""
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight [N, K], got shape {tuple(w.shape)}")
    xb = _blocks(w)
    ws2 = torch.as_tensor(weight_scale_2, dtype=torch.float32, device=w.device).reshape(())
    gs = 1.0 / ws2
    decode = 1.0 / gs
    amax = _block_amax(xb)
    sf_hp6 = (amax / E2M1_MAX) * gs
    candidates = []
    for sf_hp in (sf_hp6 * 1.5, sf_hp6):
        sf = e4m3_encode(sf_hp)
        inv = torch.clamp(1.0 / (sf.float() * decode), max=FLOAT32_MAX)
        codes = e2m1_encode(xb * inv.unsqueeze(-1))
        deq = e2m1_decode(codes) * sf.float().unsqueeze(-1) * decode
        err = (deq - xb).square().sum(-1)
        candidates.append((sf, codes, err))
    (sf4, codes4, err4), (sf6, codes6, err6) = candidates
    take4 = err4 < err6
    zero = amax == 0
    sf = torch.where(take4, sf4.float(), sf6.float())
    sf = torch.where(zero, torch.zeros_like(sf), sf).to(torch.float8_e4m3fn)
    codes = torch.where(take4.unsqueeze(-1), codes4, codes6)
    codes = torch.where(zero.unsqueeze(-1), torch.zeros_like(codes), codes).reshape(w.shape)
    return NVFP4Weight(pack_nibbles(codes), sf, ws2.clone())


def quantize_online(w: torch.Tensor, recipe: str = "modelopt") -> NVFP4Weight:
    """One tensor, online: SGLang's decode scale, then the named recipe's codes and block scales."""
    ws2 = online_weight_scale_2(w)
    if recipe == "modelopt":
        return quantize_modelopt(w, ws2)
    if recipe == "4over6":
        return quantize_4over6(w, ws2)
    raise ValueError(f"unknown online recipe {recipe!r}; known: {', '.join(RECIPES)}")


def quantize_experts_online(
    w13_hp: torch.Tensor,
    w2_hp: torch.Tensor,
    activation: str = "swiglu",
    recipe: str = "modelopt",
    activation_params: dict | None = None,
) -> ExpertWeights:
    """BF16 experts ``w13_hp [E, 2I, H]`` (halves ``[gate; up]``; ``[E, I, H]`` for relu2) and
    ``w2_hp [E, H, I]`` -> NVFP4 experts in checkpoint form, quantized expert by expert as SGLang's
    online loader does (gate+up share one decode scale)."""
    if w13_hp.dim() != 3 or w2_hp.dim() != 3 or w13_hp.shape[0] != w2_hp.shape[0]:
        raise ValueError(f"expected w13 [E, 2I, H] and w2 [E, H, I], got {tuple(w13_hp.shape)}, {tuple(w2_hp.shape)}")
    p13, s13, ss13, p2, s2, ss2 = [], [], [], [], [], []
    for e in range(w13_hp.shape[0]):
        q13 = quantize_online(w13_hp[e], recipe)
        q2 = quantize_online(w2_hp[e], recipe)
        p13.append(q13.packed)
        s13.append(q13.block_scale)
        ss13.append(q13.weight_scale_2.reshape(1).expand(2))
        p2.append(q2.packed)
        s2.append(q2.block_scale)
        ss2.append(q2.weight_scale_2.reshape(()))
    return ExpertWeights(
        torch.stack(p13), torch.stack(s13), torch.stack(ss13).contiguous(),
        torch.stack(p2), torch.stack(s2), torch.stack(ss2),
        activation, dict(activation_params or {}),
    )


def dequantize_experts(experts: ExpertWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(w13 [E, 2I, H], w2 [E, H, I])`` of quantized experts (gate/up with their own scales)."""
    w13 = torch.stack([
        torch.cat([
            dequantize(experts.w13[e][:half], experts.w13_scale[e][:half], experts.w13_scale_2[e][0]),
            dequantize(experts.w13[e][half:], experts.w13_scale[e][half:], experts.w13_scale_2[e][-1]),
        ])
        for e in range(experts.num_local_experts)
        for half in [experts.w13.shape[1] // 2 if experts.activation != "relu2" else experts.w13.shape[1]]
    ])
    w2 = dequantize(experts.w2, experts.w2_scale, experts.w2_scale_2)
    return w13, w2
