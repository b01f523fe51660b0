"""``python -m reference_impl.server``: parse flags, start the ranks, serve HTTP on rank 0."""
from __future__ import annotations

import argparse
import os
import sys
import threading
import traceback
from pathlib import Path

from reference_impl.server.parallel import LaunchConfig, RankRuntime, Topology, free_port, worker_main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m reference_impl.server", description=__doc__)
    ap.add_argument("--model-path", required=True, help="ModelOpt NVFP4 checkpoint directory (HF layout)")
    ap.add_argument("--tokenizer-path", default=None,
                    help="tokenizer.json, or a directory holding one (default: the model directory)")
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: local only)")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--tp", "--tp-size", dest="tp", type=int, default=1, help="number of ranks (tensor parallel)")
    ap.add_argument("--dp", "--dp-size", dest="dp", type=int, default=1, help="data-parallel attention groups")
    ap.add_argument("--ep", "--ep-size", dest="ep", type=int, default=1, help="expert-parallel ranges")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="cpu (gloo) or cuda (NCCL, one GPU per rank); auto picks cuda when available")
    ap.add_argument("--log-level", default="warning")
    return ap.parse_args(argv)


def resolve_device(choice: str, world: int) -> str:
    import torch

    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device visible")
        if torch.cuda.device_count() < world:
            raise SystemExit(f"--tp {world} needs {world} GPUs, {torch.cuda.device_count()} visible")
    return choice


def _exit_if_a_rank_dies(workers) -> None:
    """A dead rank leaves the others blocked in collectives: stop the whole server so health checks fail."""
    import time

    while all(p.exitcode is None for p in workers):
        time.sleep(0.5)
    dead = [p.name for p in workers if p.exitcode not in (None, 0)]
    if dead:
        print(f"reference server: {', '.join(dead)} died; exiting", file=sys.stderr, flush=True)
        os._exit(1)


def resolve_tokenizer(model_path: str, tokenizer_path: str | None) -> Path:
    """tokenizer.json from ``--tokenizer-path`` (a file or a directory holding one), else the model's."""
    base = Path(tokenizer_path or model_path)
    path = base / "tokenizer.json" if base.is_dir() else base
    if not path.is_file():
        where = f"--tokenizer-path {tokenizer_path}" if tokenizer_path else f"{model_path} (the model directory)"
        raise SystemExit(f"reference server: no tokenizer.json in {where}; ModelOpt exports have none: pass "
                         f"--tokenizer-path PATH (a tokenizer.json or the original model's directory)")
    return path


def launch(args: argparse.Namespace, runtime_cls=RankRuntime, scheduler_cls=None, worker_target=worker_main) -> None:
    """Start ranks 1..N-1 as processes (running ``worker_target``), build rank 0 and serve until
    interrupted. Raises on any start-up failure; :func:`main` turns that into a prompt non-zero exit."""
    # The HTTP stack first: a broken environment fails here, before any rank, device or weight exists.
    import torch.multiprocessing as mp
    import uvicorn
    from tokenizers import Tokenizer

    from reference_impl.server.app import Scheduler, create_app

    try:
        topo = Topology(args.tp, args.dp, args.ep)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    tok_path = resolve_tokenizer(args.model_path, args.tokenizer_path)
    tokenizer = Tokenizer.from_file(str(tok_path))
    device = resolve_device(args.device, topo.world)
    cfg = LaunchConfig(args.model_path, topo, device, f"tcp://127.0.0.1:{free_port()}")
    ctx = mp.get_context("spawn")
    scheduler = None
    try:
        for rank in range(1, topo.world):
            p = ctx.Process(target=worker_target, args=(rank, cfg), daemon=True, name=f"rank{rank}")
            p.start()
            _WORKERS.append(p)
        if _WORKERS:
            threading.Thread(target=_exit_if_a_rank_dies, args=(list(_WORKERS),), daemon=True).start()
        runtime = runtime_cls(0, cfg)
        if tokenizer.get_vocab_size(with_added_tokens=True) > runtime.engine.cfg.vocab_size:
            raise SystemExit(f"reference server: tokenizer {tok_path} has {tokenizer.get_vocab_size(with_added_tokens=True)}"
                             f" tokens, more than the model's vocabulary ({runtime.engine.cfg.vocab_size}): it does not "
                             f"fit this checkpoint")
        scheduler = (scheduler_cls or Scheduler)(runtime)
        info = {"tokenizer_path": str(tok_path), "device": device,
                "parallel": {"tp_size": topo.tp, "dp_size": topo.dp, "ep_size": topo.ep}}
        app = create_app(scheduler, tokenizer, info)
        # lifespan "on": an application that fails to start makes uvicorn stop instead of serving errors
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                               timeout_graceful_shutdown=2, lifespan="on"))
        server.run()
        if not server.started:
            raise SystemExit("reference server: the HTTP server did not start (see the log above)")
    finally:
        if scheduler is not None:
            _deadline(15.0)  # an orderly shutdown that hangs (a rank stuck in a collective) must not keep us alive
            scheduler.shutdown()


_WORKERS: list = []


def _deadline(seconds: float, code: int = 1) -> None:
    timer = threading.Timer(seconds, lambda: _hard_exit(code, f"shutdown took over {seconds:.0f} s"))
    timer.daemon = True
    timer.start()


def _hard_exit(code: int, why: str = "") -> None:
    """Stop every rank process and leave at once: interpreter shutdown may block on a rank, a CUDA/NCCL
    teardown or a non-daemon thread, and a server that cannot serve must not linger."""
    if why:
        print(f"reference server: {why}; exiting with code {code}", file=sys.stderr, flush=True)
    for p in _WORKERS:
        if p.is_alive():
            p.terminate()
    for p in _WORKERS:
        p.join(timeout=3)
        if p.is_alive():
            p.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None, **launch_kwargs) -> int:
    """Serve; any failure (start-up or later) ends the process with a non-zero code and the traceback."""
    try:
        launch(parse_args(argv), **launch_kwargs)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            if not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
            _hard_exit(exc.code if isinstance(exc.code, int) else 1)
    except KeyboardInterrupt:
        _hard_exit(130)
    except BaseException:  # noqa: BLE001 - report and leave
        traceback.print_exc()
        _hard_exit(1, "start-up or serving failed")
    _hard_exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
