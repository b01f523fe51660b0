"""The NVFP4 W4A16 reference server: SGLang's native HTTP API over the reference model.

    python -m reference_impl.server --model-path DIR [--port 30000] [--tp N --dp D --ep E] [--device cpu|cuda]

See docs/server.md. Modules: :mod:`.engine` (per-rank state and generation), :mod:`.parallel`
(torch.distributed topology and the command loop), :mod:`.app` (FastAPI endpoints and the scheduler).
"""
