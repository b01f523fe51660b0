"""Helpers more than one area's self-tests share (one area's own helpers live in its package)."""
from __future__ import annotations

import os
from typing import Callable

#: SGLang's switch that builds the FlashInfer CuTe DSL MoE wrapper W4A16 (BF16 activations) instead of W4A4
CUTEDSL_W4A16_SWITCH = "SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16"


def built_as_w4a4(ensure_cutedsl_wrapper: Callable) -> Callable:
    """SGLang's ``ensure_cutedsl_wrapper`` made to build the wrapper W4A4 whatever the W4A16 switch says: the switch
    is unset while it runs (and restored after), so BF16 activations get quantized. The rules mutants
    (tests/rules/test_rule_mutants.py) and the engine mutants (tests/engine_harness/mutants.py) plant it."""
    def ensure(layer):
        saved = os.environ.pop(CUTEDSL_W4A16_SWITCH, None)
        try:
            ensure_cutedsl_wrapper(layer)
        finally:
            if saved is not None:
                os.environ[CUTEDSL_W4A16_SWITCH] = saved
    return ensure
