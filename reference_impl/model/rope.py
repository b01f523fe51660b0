"""Rotary position embeddings as transformers computes them, for :class:`reference_impl.model.TinyModel`: the fp32
``(cos, sin)`` tables (scaled rope types -- llama3, YaRN -- from transformers' own ``ROPE_INIT_FUNCTIONS``),
DeepSeek's MLA softmax scale, and the magnitude of a rotation's two rounded products (for the error analysis)."""
from __future__ import annotations

import torch

from reference_impl.model.architectures import ModelConfig, rope_parameters


def _rope_magnitude(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """``|x cos| + |rot(x) sin|``: the two rounded products of the rotary embedding."""
    x = x.double()
    if interleave:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    h = x.shape[-1] // 2
    rotated = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return (x * cos.double()).abs() + (rotated * sin.double()).abs()


def rope_tables(cfg: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` ``[T, rope_dim]`` as transformers computes them (inverse frequencies of scaled rope
    types -- llama3, YaRN -- from transformers' own ``ROPE_INIT_FUNCTIONS``: their definition)."""
    d, params = cfg.rope_dim, rope_parameters(cfg.hf_config)
    scaling = 1.0
    if params["rope_type"] == "default":
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    else:
        inv_freq, scaling = _scaled_inv_freq(cfg)
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


_INV_FREQ_CACHE: dict[str, tuple[torch.Tensor, float]] = {}


def _scaled_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    key = repr((cfg.rope_dim, cfg.max_position_embeddings, sorted(rope_parameters(cfg.hf_config).items())))
    if key not in _INV_FREQ_CACHE:
        from reference_impl.truth.hf import hf_config

        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        hf = hf_config(cfg.hf_config)
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[hf.rope_parameters["rope_type"]](hf)
        _INV_FREQ_CACHE[key] = (inv_freq.float().cpu(), float(scaling))
    return _INV_FREQ_CACHE[key]


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """DeepSeek's ``q k^T`` scale: ``qk_head_dim^-1/2``, times YaRN's ``mscale(factor, mscale_all_dim)^2``."""
    import math

    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    params = rope_parameters(cfg.hf_config)
    if params["rope_type"] != "default" and params.get("mscale_all_dim") and params["factor"] > 1:
        m = 0.1 * params["mscale_all_dim"] * math.log(params["factor"]) + 1.0
        scale = scale * m * m
    return scale
