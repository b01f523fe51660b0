"""The NVFP4 format area: E2M1/E4M3 codes, packing, scale layouts, quantization recipes (cases, inputs, oracles)."""
