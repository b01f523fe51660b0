"""Server scenarios: an engine's HTTP server (SGLang's native API, the OpenAI-compatible API or vLLM's, one
:mod:`.dialects` class each, ``--server-api``) under reload, memory release/resume, concurrency and
determinism scenarios (docs/contracts.md section 6), against the tiny NVFP4 fixture checkpoints or your own.

Modules: :mod:`.dialects` (the API the scenarios speak; bounded HTTP, 127.0.0.1 only), :mod:`.client`
(what the dialects share: deadlines, one generation), :mod:`.launcher` (start a server from a command
template and clean it up), :mod:`.configs` (parallel configurations per tier), :mod:`.models` (fixture
checkpoints), :mod:`.bounds` (derived tolerances), :mod:`.scenarios` (the checks: their list and how one runs;
the checks themselves in :mod:`.scenarios_reload` and :mod:`.scenarios_consistency`, sharing
:mod:`.scenario_context`).
"""
