"""compressed-tensors NVFP4A16 checkpoints for the self-tests, written by compressed-tensors itself at test time.

    python tests/reference/ct_exporter.py OUT [--seed 0]

A tiny randomly initialised ``transformers`` Llama (the same model as tests/reference/modelopt_exporter.py) gets
llm-compressor's ``NVFP4A16`` preset scheme (``preset_name_to_scheme("NVFP4A16", ["Linear"])``, ``lm_head``
ignored) through compressed-tensors' ``apply_quantization_config``; its weight quantization parameters are
computed with compressed-tensors' own ``generate_gparam`` (the tensor-wide global scale) and
``calculate_qparams`` (the 16-element group scales), exactly what llm-compressor's min-max observer feeds them;
``ModelCompressor.compress_model`` packs the weights (``NVFP4PackedCompressor``) and ``update_config`` writes
the ``quantization_config`` into ``config.json``. Nothing here quantizes or packs by itself.
"""
from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch

from tests.reference.modelopt_exporter import _model


def _observe(module: torch.nn.Module) -> None:
    """The weight's global and group scales, by compressed-tensors' own parameter functions."""
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    args = module.quantization_scheme.weights
    w = module.weight.detach()
    global_scale = generate_gparam(w.amin(), w.amax())
    groups = w.reshape(w.shape[0], w.shape[1] // args.group_size, args.group_size)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=global_scale)
    module.weight_global_scale.data.copy_(global_scale)
    module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))


def export(out: Path, seed: int = 0) -> Path:
    """Quantize a fresh tiny Llama with compressed-tensors' NVFP4A16 scheme and save it into ``out``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus, apply_quantization_config,
                                                 preset_name_to_scheme)

    model = _model("llama", False, torch.bfloat16, seed)
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("NVFP4A16", ["Linear"])},
                                ignore=["lm_head"], quantization_status=QuantizationStatus.INITIALIZED)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        apply_quantization_config(model, config, show_progress=False)
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is not None:
                _observe(module)
                module.quantization_status = QuantizationStatus.FROZEN
        compressor = ModelCompressor.from_pretrained_model(model, quantization_format="nvfp4-pack-quantized")
        compressor.compress_model(model)
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        compressor.update_config(str(out))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    export(a.out, a.seed)


if __name__ == "__main__":
    main()
