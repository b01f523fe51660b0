"""NVFP4 W4A16 conformance suite."""

__version__ = "0.2.0"
