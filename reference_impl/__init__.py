"""The pure-PyTorch reference of NVFP4 W4A16, grouped by topic:

* :mod:`.format` -- the NVFP4 format (:mod:`.format.nvfp4`) and online quantization;
* :mod:`.dense` -- the W4A16 linear (and :mod:`.dense.exact_dot`, exact dot products);
* :mod:`.moe` -- the fused MoE, its experts record (:mod:`.moe.experts`), grouped evaluation and routing;
* :mod:`.model` -- architectures, checkpoints (ModelOpt, compressed-tensors), the hand-written model, rotary tables;
* :mod:`.bounds` -- the derived error bounds the checks compare against;
* :mod:`.rules` -- the engines' configuration rules (SGLang, vLLM), the LM-head guard, reloads;
* :mod:`.truth` -- the golden truth (the exact model, transformers instrumented, forward-mode probes);
* :mod:`.server` -- the reference server; :mod:`.flashinfer_emulator` -- FlashInfer's W4A16 API on any device.

Modules that moved into the topics in 0.3 are still importable by their 0.2 names (``reference_impl.nvfp4``,
``reference_impl.config_rules`` ...): :data:`MOVED` maps each to its new home, and the old name is the very same
module object (patching either patches both).
"""
from __future__ import annotations

__version__ = "0.2.0"

import importlib
import importlib.abc
import importlib.util
import sys

#: 0.2 module name -> its home since 0.3 (both under ``reference_impl``)
MOVED = {
    "nvfp4": "format.nvfp4", "online_quant": "format.online_quant",
    "exact_dot": "dense.exact_dot",
    "moe_experts": "moe.experts", "moe_grouped": "moe.grouped", "_triton_grouped_gemm": "moe._triton_grouped_gemm",
    "routing": "moe.routing",
    "architectures": "model.architectures", "checkpoint": "model.checkpoint",
    "compressed_tensors": "model.compressed_tensors", "rope": "model.rope",
    "golden": "truth.golden",
    "config_rules": "rules.sglang", "config_paths": "rules.sglang_paths", "vllm_rules": "rules.vllm",
    "lm_head": "rules.lm_head", "reload": "rules.reload",
}


class _OldNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``reference_impl.<old>`` as the module now at ``reference_impl.<new>`` (the same object)."""

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, old = fullname.partition(".")
        if prefix != __name__ or old not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(f"{__name__}.{MOVED[spec.name.partition('.')[2]]}")

    def exec_module(self, module) -> None:
        pass  # already executed under its new name


if not any(isinstance(f, _OldNames) for f in sys.meta_path):
    sys.meta_path.append(_OldNames())
