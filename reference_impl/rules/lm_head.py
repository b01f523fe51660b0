"""Whether the output head runs its quantized method (docs/contracts.md section 5; SGLang 0.5.23
``logits_processor.should_apply_lm_head_quant_method``).

A draft model can share the target's dense (float) head while carrying its own stale ModelOpt method, so
the method is used only when the head's runtime state matches it: the weight dtype the prepared method
leaves behind, plus the attributes its ``apply`` reads. Inputs are plain descriptions, not modules:
``method`` is the method's class name (``None``: no method), ``quant_mode`` its mode (ModelOptFp4LinearMethod
only), ``weight_dtype`` the head weight's dtype name (``None``: no weight), ``attrs`` the attributes present.
"""
from __future__ import annotations

from collections.abc import Collection

UNQUANTIZED_METHODS = frozenset({"UnquantizedEmbeddingMethod", "UnquantizedLinearMethod", "PackWeightMethod"})

_SIZES = ("input_size_per_partition", "output_size_per_partition")
# Attributes each prepared form leaves on the layer (and its apply() reads).
W4A16_ATTRS = ("weight_scale_interleaved", "alpha", *_SIZES)          # uint8 weight, BF16 activations
W4A4_ATTRS = ("weight_scale_interleaved", "alpha", "input_scale_inv", *_SIZES)  # uint8 weight, FP4 activations
MARLIN_ATTRS = ("weight_scale", "weight_global_scale", "workspace", *_SIZES)    # int32 repacked weight
FP8_ATTRS = ("weight_scale", "input_scale")


def should_apply_lm_head_quant_method(
    method: str | None, quant_mode: str | None, weight_dtype: str | None, attrs: Collection[str], has_apply: bool = True
) -> bool:
    if method is None or weight_dtype is None or not has_apply:
        return False
    if method in UNQUANTIZED_METHODS:
        return False
    present = set(attrs)

    def state(dtype: str, needed: tuple[str, ...]) -> bool:
        return weight_dtype == dtype and present.issuperset(needed)

    if method == "ModelOptFp4LinearMethod":
        if quant_mode == "w4a16":
            # W4A16 keeps activations BF16: no input_scale_inv is prepared, so it must not be required.
            return state("uint8", W4A16_ATTRS)
        return state("int32", MARLIN_ATTRS) or state("uint8", W4A4_ATTRS)
    if method == "ModelOptNvFp4A16LinearMethod":
        return state("int32", MARLIN_ATTRS)
    if method == "ModelOptFp8LinearMethod":
        return state("float8_e4m3fn", FP8_ATTRS)
    return True  # any other method with an apply() owns its head
