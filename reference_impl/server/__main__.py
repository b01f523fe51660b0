"""``python -m reference_impl.server``: parse flags, start the ranks, serve HTTP on rank 0."""
from __future__ import annotations

import argparse
import os
import threading
import sys
from pathlib import Path

from .parallel import LaunchConfig, RankRuntime, Topology, free_port, worker_main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m reference_impl.server", description=__doc__)
    ap.add_argument("--model-path", required=True, help="ModelOpt NVFP4 checkpoint directory (HF layout)")
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


def launch(args: argparse.Namespace, runtime_cls=RankRuntime, scheduler_cls=None) -> None:
    """Start ranks 1..N-1 as processes, build rank 0 and serve until interrupted."""
    import torch.multiprocessing as mp
    import uvicorn
    from tokenizers import Tokenizer

    from .app import Scheduler, create_app

    try:
        topo = Topology(args.tp, args.dp, args.ep)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    tok_path = Path(args.model_path) / "tokenizer.json"
    if not tok_path.is_file():
        raise SystemExit(f"{args.model_path}: no tokenizer.json")
    device = resolve_device(args.device, topo.world)
    cfg = LaunchConfig(args.model_path, topo, device, f"tcp://127.0.0.1:{free_port()}")
    workers = []
    if topo.world > 1:
        ctx = mp.get_context("spawn")
        for rank in range(1, topo.world):
            p = ctx.Process(target=worker_main, args=(rank, cfg), daemon=True, name=f"rank{rank}")
            p.start()
            workers.append(p)
    if workers:
        threading.Thread(target=_exit_if_a_rank_dies, args=(workers,), daemon=True).start()
    runtime = runtime_cls(0, cfg)
    scheduler = (scheduler_cls or Scheduler)(runtime)
    info = {"tokenizer_path": str(tok_path), "device": device,
            "parallel": {"tp_size": topo.tp, "dp_size": topo.dp, "ep_size": topo.ep}}
    app = create_app(scheduler, Tokenizer.from_file(str(tok_path)), info)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=2)
    finally:
        scheduler.shutdown()
        for p in workers:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()


def main(argv: list[str] | None = None) -> int:
    launch(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
