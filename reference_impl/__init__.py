"""Pure-PyTorch reference for NVFP4 W4A16: format, dense and MoE math, configuration rules,
LM-head guard, checkpoints and a small reference server."""

__version__ = "0.2.0"
