"""Server scenarios: an engine's HTTP server (SGLang native API) under reload, memory release/resume,
concurrency and determinism scenarios (SPEC.md section 6), against the tiny NVFP4 fixture checkpoints.

Modules: :mod:`.client` (bounded HTTP client, 127.0.0.1 only, deadlines), :mod:`.launcher` (start a server
from a command template and clean it up), :mod:`.configs` (parallel configurations per tier),
:mod:`.models` (fixture checkpoints), :mod:`.bounds` (derived tolerances), :mod:`.scenarios` (the checks).
"""
