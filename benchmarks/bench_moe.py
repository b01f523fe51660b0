"""The reference W4A16 fused MoE against a BF16 MoE on the same routing (``torch._grouped_mm`` grouped GEMMs,
SwiGLU, weighted combine; a per-expert ``torch.mm`` loop where the build lacks ``_grouped_mm``), per expert
shape and token count, measured in one run (CUDA events, warm-up, median of repeats, L2 flushed before each
timed call: :mod:`conformance.perf.measure`). Prints a table.

    python benchmarks/bench_moe.py            # Mixtral-like (8 x 4096x14336, top-2) and DeepSeek-like
                                              # (256 x 7168x2048, top-8) at T = 1 16 256 4096, on CUDA
    python benchmarks/bench_moe.py --tiny     # a small layer (runs on CPU: a smoke test)

Columns: reference time, achieved GB/s (packed weights and scales of the experts the routing uses, plus
activations in and out) and TFLOP/s; the baseline's time and the ratio; the ratio to the W4A16 floor; the
one-time prepare (decode of every local expert to exact bf16); peak extra memory of a call (CUDA only).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_dense import _mib, peak_extra_bytes, wall  # noqa: E402
from conformance.perf import measure as perf  # noqa: E402
from conformance.adapters.reference.kernel import ReferenceBackend  # noqa: E402


def bench(shapes, tokens, timer: perf.Timer, rates: perf.DeviceRates) -> list[dict]:
    device = timer.device
    backend = ReferenceBackend()
    results, cache = [], {}
    for name, experts, hidden, inter, top_k in shapes:
        for t in tokens:
            row = perf.measure_moe(backend, name, experts, hidden, inter, top_k, t, rates, timer, cache)
            layer, prepared, _ = cache[(backend.name, name)]
            ids, weights = perf.random_routing(t, experts, top_k, device)
            x = torch.randn(t, hidden, device=device).bfloat16()
            peak = peak_extra_bytes(lambda: backend.run_moe(prepared, x, ids, weights), device)
            results.append(dict(row=row, peak_run=peak, experts_bf16=experts * 3 * hidden * inter * 2))
        results[-1]["t_prepare"] = wall(lambda: backend.prepare_moe(layer, device), device)
    return results


def print_table(results: list[dict], rates: perf.DeviceRates) -> None:
    print(f"reference W4A16 MoE vs {results[0]['row'].baseline}, torch {torch.__version__}; {perf.format_rate(rates)}")
    header = ("shape", "T", "ref ms", "GB/s", "TFLOP/s", "bf16 ms", "ref/bf16", "ref/floor", "run peak MiB",
              "bf16 experts MiB", "prepare ms")
    rows = [header]
    for r in results:
        row = r["row"]
        rows.append((row.shape, str(row.tokens), f"{row.time_s * 1e3:.3f}", f"{row.gbps:.0f}", f"{row.tflops:.1f}",
                     f"{row.baseline_s * 1e3:.3f}", f"{row.vs_bf16:.2f}x", f"{row.vs_floor:.2f}x", _mib(r["peak_run"]),
                     _mib(r["experts_bf16"]), f"{r['t_prepare'] * 1e3:.1f}" if "t_prepare" in r else ""))
    widths = [max(len(c[i]) for c in rows) for i in range(len(header))]
    for c in rows:
        print(" | ".join(v.rjust(w) for v, w in zip(c, widths)))
    worst = max(results, key=lambda r: r["row"].vs_bf16)["row"]
    print(f"worst ratio to the BF16 MoE: {worst.vs_bf16:.3f}x ({worst.shape}, T={worst.tokens})")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a small layer (default on CPU)")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="token counts (default 1 16 256 4096)")
    parser.add_argument("--repeats", type=int, default=perf.REPEATS)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    tiny = args.tiny or device.type == "cpu"
    shapes = perf.CPU_MOE_SHAPES if tiny else perf.MOE_SHAPES
    tokens = args.tokens or ([1, 16, 64] if tiny else list(perf.PERF_TOKENS))
    timer = perf.Timer(device, repeats=args.repeats)
    rates = perf.measure_device_rates(device)
    results = bench(shapes, tokens, timer, rates)
    print_table(results, rates)
    return results


if __name__ == "__main__":
    main()
