"""How much one server calibration varies, idle and with the CPU loaded: the figures behind the pace's MARGIN
(conformance/interfaces/server_pace.py). Starts the reference server on a fixture model, then calibrates it
``--repeats`` times (one greedy batch of the scenario prompts, one 1-token probe: exactly what the suite times
after each server start) with no load, and again beside ``--burners`` busy-loop processes. Prints a table: per
condition the min / median / max of each timing, max/min (the spread a single calibration can have), and the
loaded median over the idle median (the slowdown a probe must measure).

    python benchmarks/bench_pace.py                       # dense fixture, 20 repeats, one burner per core
    python benchmarks/bench_pace.py --repeats 50 --burners 4
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conformance.server.dialects import make_dialect  # noqa: E402
from conformance.server.launcher import REFERENCE_TEMPLATE, ServerProcess  # noqa: E402
from conformance.server.models import ModelCatalog  # noqa: E402
from conformance.server.scenarios import calibrate, fresh_outputs  # noqa: E402

BURN = "while True:\n    pass\n"


def measure(url: str, repeats: int) -> tuple[list[float], list[float]]:
    client = make_dialect("sglang", url, max_request_s=300.0)
    gen, probe = [], []
    for _ in range(repeats):
        c = calibrate(client, 0.0).calibration
        gen.append(c.generate_s)
        probe.append(c.probe_s)
    client.close()
    return gen, probe


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="dense-nvfp4_awq", help="fixture family (default dense-nvfp4_awq)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--burners", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()

    model = ModelCatalog([], None, [], None).served(args.family)
    server = ServerProcess(REFERENCE_TEMPLATE, 240.0, model_path=model.a, tokenizer_path=model.tokenizer, tp=1,
                           dp=1, ep=1, device="cpu")
    try:
        fresh_outputs(make_dialect("sglang", server.url, max_request_s=300.0))
        idle = measure(server.url, args.repeats)
        burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(args.burners)]
        try:
            time.sleep(1.0)
            loaded = measure(server.url, args.repeats)
        finally:
            for b in burners:
                b.kill()
                b.wait()
    finally:
        server.stop()

    print(f"reference server, {args.family}, {args.repeats} calibrations per condition, {os.cpu_count()} CPU cores")
    print(f"{'condition':<22} {'timing':<14} {'min s':>7} {'median s':>9} {'max s':>7} {'max/min':>8}")
    for name, (gen, probe) in (("idle", idle), (f"{args.burners} burners", loaded)):
        for label, xs in (("greedy batch", gen), ("1-token probe", probe)):
            print(f"{name:<22} {label:<14} {min(xs):>7.3f} {statistics.median(xs):>9.3f} {max(xs):>7.3f} "
                  f"{max(xs) / min(xs):>8.2f}")
    for i, label in enumerate(("greedy batch", "1-token probe")):
        ratio = statistics.median(loaded[i]) / statistics.median(idle[i])
        print(f"loaded / idle median, {label}: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
