"""transformers' own classes for each architecture (reference_impl.model.architectures), built from a checkpoint's
``config.json`` without the model hub: the config, and the modules the truth instantiates one at a time."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from reference_impl.model.architectures import MODEL_TYPES, ModelConfig

_CLASS_PREFIX = {"llama": "Llama", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral",
                 "deepseek_v3": "DeepseekV3"}
_DROP = ("quantization_config", "auto_map", "architectures")


def hf_config(config_json: dict, attn_implementation: str | None = None, experts_implementation: str | None = None):
    """transformers' config object of a checkpoint's config.json (its own config class reads every field)."""
    import transformers

    d = {k: v for k, v in config_json.items() if k not in _DROP}
    model_type = d.pop("model_type", None)
    if model_type is None:
        raise ValueError("config.json has no model_type")
    cfg = transformers.AutoConfig.for_model(model_type, **d)
    cfg.architectures = list(config_json.get("architectures") or [])
    if attn_implementation:
        cfg._attn_implementation = attn_implementation
    if experts_implementation:
        cfg._experts_implementation = experts_implementation
    return cfg


@dataclass(frozen=True)
class Classes:
    module: ModuleType      # transformers.models.<type>.modeling_<type>
    decoder_layer: type
    rms_norm: type
    rotary: type
    causal_lm: type


def classes(cfg: ModelConfig) -> Classes:
    mt = MODEL_TYPES[cfg.arch]
    mod = importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
    p = _CLASS_PREFIX[cfg.arch]
    return Classes(mod, getattr(mod, f"{p}DecoderLayer"), getattr(mod, f"{p}RMSNorm"),
                   getattr(mod, f"{p}RotaryEmbedding"), getattr(mod, f"{p}ForCausalLM"))
