"""The reference server's app served in-process by uvicorn on a free local port (one rank, CPU), for tests
whose client needs a real HTTP server (SGLang's and OpenAI's clients, the scenario suite's dialects)."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from reference_impl.server.parallel import LaunchConfig, RankRuntime, Topology, free_port


@contextmanager
def live_reference_server(model_path: str | Path, start_timeout_s: float = 30.0) -> Iterator[tuple[str, object]]:
    """Yields (base URL, rank 0's engine); stops the server and its scheduler on exit."""
    import uvicorn
    from tokenizers import Tokenizer

    from reference_impl.server.app import Scheduler, create_app

    path = str(model_path)
    runtime = RankRuntime(0, LaunchConfig(path, Topology(), "cpu"))
    scheduler = Scheduler(runtime)
    tokenizer_path = f"{path}/tokenizer.json"
    app = create_app(scheduler, Tokenizer.from_file(tokenizer_path),
                     {"tokenizer_path": tokenizer_path, "device": "cpu",
                      "parallel": {"tp_size": 1, "dp_size": 1, "ep_size": 1}})
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="reference-server", daemon=True)
    thread.start()
    try:
        end = time.monotonic() + start_timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > end:
                raise RuntimeError(f"in-process reference server did not start within {start_timeout_s} s")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}", runtime.engine
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        scheduler.shutdown()
