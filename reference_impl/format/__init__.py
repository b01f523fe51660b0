"""The NVFP4 format: codes, block scales, packing and swizzles (:mod:`.nvfp4`), and online quantization
(:mod:`.online_quant`)."""
